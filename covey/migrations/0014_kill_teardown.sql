-- What the daemon's stop cut, as it said in its last message (`cut` of `kill_ack` or
-- `stopping`): the tool call under way (name, pid = pgid, how long it had run) and how many
-- of the tools' processes it killed.
ALTER TABLE sessions ADD COLUMN tool_cut jsonb;
-- The second line: a daemon that has not acknowledged its kill within the bound
-- (COVEY_KILL_ACK_BOUND_MS) has its sandbox torn down by the runner, and the kill is then
-- confirmed by that teardown. Never an obeyed kill: only `kill_ack` is obedience.
ALTER TABLE sessions DROP CONSTRAINT IF EXISTS sessions_kill_confirmed_by_check;
ALTER TABLE sessions ADD CONSTRAINT sessions_kill_confirmed_by_check
    CHECK (kill_confirmed_by IN ('kill_ack', 'lease', 'hang_up', 'teardown'));
