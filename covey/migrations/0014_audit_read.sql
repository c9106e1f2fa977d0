-- GET /api/v1/audit reads an organisation's entries newest first, a page at a time.
CREATE INDEX audit_log_org_id ON audit_log (org_id, id DESC);
