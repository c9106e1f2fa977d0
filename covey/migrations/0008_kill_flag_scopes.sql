-- Kill flags with scopes (DESIGN §2.4): a dial, not only a hammer. The org flag stays
-- organizations.fleet_killed and the agent flag agents.killed; this table holds the two
-- scopes that had no home: global (every organisation on this control plane) and tool
-- (one tool, for one agent or for the whole organisation). A cleared flag is deleted; the
-- audit log keeps who set and cleared it, and why.
CREATE TABLE kill_flags (
    id        uuid PRIMARY KEY,
    scope     text NOT NULL CHECK (scope IN ('global', 'tool')),
    org_id    uuid REFERENCES organizations(id),
    agent_id  uuid REFERENCES agents(id),
    tool      text,
    reason    text NOT NULL,
    set_by    uuid REFERENCES humans(id),
    set_at    timestamptz NOT NULL DEFAULT now(),
    CHECK ((scope = 'global' AND org_id IS NULL AND agent_id IS NULL AND tool IS NULL)
        OR (scope = 'tool' AND org_id IS NOT NULL AND tool IS NOT NULL))
);
-- One flag per target: setting it twice is idempotent.
CREATE UNIQUE INDEX kill_flags_one_per_target ON kill_flags
    (scope, COALESCE(org_id, '00000000-0000-0000-0000-000000000000'),
     COALESCE(agent_id, '00000000-0000-0000-0000-000000000000'), COALESCE(tool, ''));

-- Why the fleet stop was pulled, shown on /administration beside who and when.
ALTER TABLE organizations ADD COLUMN fleet_killed_reason text;
