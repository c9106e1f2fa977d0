-- How a session's daemon stopped. Exit code 3 alone cannot tell an obeyed kill from a lease
-- that ran out: a daemon deaf to `kill` once exited 3 two seconds later, with the same log
-- lines, and was counted as having obeyed. So the record keeps what the daemon said in its
-- last message (daemon_stop) and how the kill sent to it was confirmed: by its `kill_ack`,
-- by a hang-up after its lease ran out, or by a bare hang-up.
ALTER TABLE sessions ADD COLUMN daemon_stop text
    CHECK (daemon_stop IN ('kill', 'lease', 'guard', 'sleep', 'error'));
ALTER TABLE sessions ADD COLUMN daemon_stop_detail text;
ALTER TABLE sessions ADD COLUMN kill_sent_at timestamptz;
ALTER TABLE sessions ADD COLUMN kill_confirmed_at timestamptz;
ALTER TABLE sessions ADD COLUMN kill_confirmed_by text
    CHECK (kill_confirmed_by IN ('kill_ack', 'lease', 'hang_up'));
