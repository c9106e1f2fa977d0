-- What the daemon's stop cut, as it said in its last message (`cut` of `kill_ack` or
-- `stopping`): the tool call under way (name, pid = pgid, how long it had run) and how many
-- of the tools' processes it killed.
ALTER TABLE sessions ADD COLUMN tool_cut jsonb;
