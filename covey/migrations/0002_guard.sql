-- Guard thresholds per agent (loop window, breaker cooldown, …); absent keys take the
-- daemon's defaults. Budget and step limit stay in budget_usd and max_turns.
ALTER TABLE agents ADD COLUMN guard jsonb NOT NULL DEFAULT '{}'::jsonb;
