-- Time-to-stop in real parts: when the sandbox's daemon exited, and when the sandbox itself
-- was gone (its processes reaped, its container removed). `ended_at` once stood for both,
-- and every game day reported the same instant as two measurements.
ALTER TABLE sandboxes ADD COLUMN daemon_exited_at timestamptz;
ALTER TABLE sandboxes ADD COLUMN gone_at timestamptz;
