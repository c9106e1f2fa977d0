-- Where a sandbox lives, and since when it is parked: a parked sandbox's home is on the node
-- that ran it, so only that node may reuse, sync or discard it.
ALTER TABLE sandboxes ADD COLUMN node text NOT NULL DEFAULT '';
ALTER TABLE sandboxes ADD COLUMN parked_at timestamptz;
CREATE INDEX sandboxes_parked ON sandboxes (node) WHERE state IN ('parked','evicted');
