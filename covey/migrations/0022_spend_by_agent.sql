-- Spend in plain sight: every agent read sums its cost entries (and each session's), which
-- without an index meant reading every entry of every agent.
CREATE INDEX cost_entries_agent ON cost_entries (agent_id, session_id);
