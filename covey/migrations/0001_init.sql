-- The control plane's whole state. Kill flags live here and nowhere else: a replica that
-- restarts, or a second replica, must see the same switches.

CREATE TABLE organizations (
    id            uuid PRIMARY KEY,
    name          text NOT NULL UNIQUE,
    fleet_killed  boolean NOT NULL DEFAULT false,
    fleet_killed_at timestamptz,
    fleet_killed_by uuid,
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE humans (
    id            uuid PRIMARY KEY,
    org_id        uuid NOT NULL REFERENCES organizations(id),
    email         text NOT NULL UNIQUE,
    password_hash text NOT NULL,
    role          text NOT NULL CHECK (role IN
                  ('org_admin','agent_owner','security','auditor','controlling','platform_admin')),
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE web_sessions (
    token_hash    text PRIMARY KEY,
    human_id      uuid NOT NULL REFERENCES humans(id),
    expires_at    timestamptz NOT NULL
);

CREATE TABLE api_tokens (
    token_hash    text PRIMARY KEY,
    human_id      uuid NOT NULL REFERENCES humans(id),
    name          text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE agents (
    id            uuid PRIMARY KEY,
    org_id        uuid NOT NULL REFERENCES organizations(id),
    slug          text NOT NULL,
    display_name  text NOT NULL,
    owner_id      uuid REFERENCES humans(id),
    status        text NOT NULL DEFAULT 'sleeping'
                  CHECK (status IN ('sleeping','triggered','working','securing','killed')),
    killed        boolean NOT NULL DEFAULT false,
    -- Who set the flag: 'agent' (its own switch), 'fleet' (the org switch) or 'guard'.
    -- Fleet resume clears only 'fleet'; covey once cleared every flag and revived agents
    -- that had been stopped on purpose.
    kill_origin   text CHECK (kill_origin IN ('agent','fleet','guard')),
    killed_at     timestamptz,
    warm_sandbox  boolean NOT NULL DEFAULT false,
    budget_usd    numeric(12,4) NOT NULL DEFAULT 1.0,
    max_turns     integer NOT NULL DEFAULT 20,
    model         text NOT NULL DEFAULT 'puppet',
    trigger_token_hash text NOT NULL UNIQUE,
    created_at    timestamptz NOT NULL DEFAULT now(),
    UNIQUE (org_id, slug),
    CHECK (killed = (kill_origin IS NOT NULL))
);

CREATE TABLE agent_heartbeats (
    agent_id      uuid NOT NULL REFERENCES agents(id),
    name          text NOT NULL,
    task_body     text NOT NULL,
    every_seconds integer NOT NULL CHECK (every_seconds > 0),
    last_fired_at timestamptz,
    PRIMARY KEY (agent_id, name)
);

CREATE SEQUENCE fencing_tokens;

CREATE TABLE backlog_tasks (
    id            uuid PRIMARY KEY,
    org_id        uuid NOT NULL REFERENCES organizations(id),
    agent_id      uuid NOT NULL REFERENCES agents(id),
    title         text NOT NULL,
    body          text NOT NULL DEFAULT '',
    state         text NOT NULL DEFAULT 'open'
                  CHECK (state IN ('open','in_progress','blocked','done','failed','cancelled')),
    priority      integer NOT NULL DEFAULT 0,
    origin        text NOT NULL DEFAULT 'api'
                  CHECK (origin IN ('api','heartbeat','trigger')),
    claim_token   bigint,
    claimed_by    uuid,
    daemon_retries integer NOT NULL DEFAULT 0,
    result        text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX backlog_open ON backlog_tasks (agent_id, priority DESC, created_at)
    WHERE state = 'open';
CREATE INDEX backlog_in_progress ON backlog_tasks (agent_id) WHERE state = 'in_progress';

CREATE TABLE task_transitions (
    id            bigserial PRIMARY KEY,
    task_id       uuid NOT NULL REFERENCES backlog_tasks(id),
    from_state    text,
    to_state      text NOT NULL,
    note          text NOT NULL DEFAULT '',
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX task_transitions_task ON task_transitions (task_id, id);

CREATE TABLE sandboxes (
    id            uuid PRIMARY KEY,
    agent_id      uuid NOT NULL REFERENCES agents(id),
    backend       text NOT NULL,
    handle        text,
    state         text NOT NULL DEFAULT 'starting'
                  CHECK (state IN ('starting','running','parked','evicted','gone')),
    daemon_token_hash text,
    token_expires_at  timestamptz,
    token_used    boolean NOT NULL DEFAULT false,
    exit_code     integer,
    last_sync_at  timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    ended_at      timestamptz
);
CREATE INDEX sandboxes_live ON sandboxes (agent_id) WHERE state IN ('starting','running','parked');

CREATE TABLE sessions (
    id            uuid PRIMARY KEY,
    agent_id      uuid NOT NULL REFERENCES agents(id),
    task_id       uuid REFERENCES backlog_tasks(id),
    sandbox_id    uuid REFERENCES sandboxes(id),
    node          text NOT NULL,
    state         text NOT NULL DEFAULT 'starting'
                  CHECK (state IN ('starting','running','ended','cancelled','lost','tripped')),
    started_at    timestamptz NOT NULL DEFAULT now(),
    ended_at      timestamptz,
    last_seen_at  timestamptz NOT NULL DEFAULT now(),
    cost_usd      numeric(12,6) NOT NULL DEFAULT 0,
    steps         integer NOT NULL DEFAULT 0,
    stop_layer    text,
    stop_reason   text
);
-- At most one live session per agent: the database, not a lock in one replica, enforces it.
CREATE UNIQUE INDEX sessions_one_live ON sessions (agent_id) WHERE state IN ('starting','running');

CREATE TABLE recording_events (
    id            bigserial PRIMARY KEY,
    agent_id      uuid NOT NULL REFERENCES agents(id),
    session_id    uuid,
    kind          text NOT NULL,
    status        text NOT NULL,
    detail        jsonb NOT NULL DEFAULT '{}'::jsonb,
    at            timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX recording_agent ON recording_events (agent_id, id);

CREATE TABLE cost_entries (
    id            bigserial PRIMARY KEY,
    agent_id      uuid NOT NULL REFERENCES agents(id),
    session_id    uuid,
    usd           numeric(12,6) NOT NULL,
    tokens        integer NOT NULL DEFAULT 0,
    at            timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE notifications (
    id            bigserial PRIMARY KEY,
    org_id        uuid NOT NULL REFERENCES organizations(id),
    class         text NOT NULL,
    kind          text NOT NULL,
    title         text NOT NULL,
    link          text NOT NULL DEFAULT '',
    recipients    uuid[] NOT NULL,
    at            timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE audit_log (
    id            bigserial PRIMARY KEY,
    org_id        uuid,
    actor_id      uuid,
    action        text NOT NULL,
    target        text NOT NULL DEFAULT '',
    detail        jsonb NOT NULL DEFAULT '{}'::jsonb,
    at            timestamptz NOT NULL DEFAULT now()
);

-- New or requeued open work wakes its agent through LISTEN/NOTIFY, whoever wrote the row
-- (an API call, a requeue, or an operator with psql). The wake itself checks the switches.
CREATE FUNCTION notify_open_task() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('covey_wake', NEW.agent_id::text);
    RETURN NEW;
END $$ LANGUAGE plpgsql;

CREATE TRIGGER backlog_open_wakes AFTER INSERT OR UPDATE OF state ON backlog_tasks
    FOR EACH ROW WHEN (NEW.state = 'open') EXECUTE FUNCTION notify_open_task();
