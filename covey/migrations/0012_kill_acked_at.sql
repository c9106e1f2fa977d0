-- When the daemon itself acknowledged the kill, on its own clock (`acked_ns` of its
-- `kill_ack`), beside when the control plane read that acknowledgement (kill_confirmed_at).
-- A model request the daemon sent after this instant is an action after its kill: judged by
-- the daemon's send stamp against it, with no queue or event loop between the two clocks.
ALTER TABLE sessions ADD COLUMN kill_acked_at timestamptz;
