-- Every change that can alter who a credential is, announced on `covey_credentials`: each
-- replica remembers callers between requests (covey/credentials.py) and forgets them on these.
-- Migration 0013 announced a session's or token's DELETE, a session's new expiry, and a
-- human's new role or organisation, for the event streams. Remembered callers need more: any
-- UPDATE of a session or token (its hash or its human rewritten), a human's new email (the
-- caller carries it), and a TRUNCATE of any of the three tables, which fires no row trigger
-- and is announced as '*' (everyone).
DROP TRIGGER web_session_ended ON web_sessions;
CREATE TRIGGER web_session_ended AFTER DELETE OR UPDATE ON web_sessions
    FOR EACH ROW EXECUTE FUNCTION notify_credential_ended();
DROP TRIGGER api_token_ended ON api_tokens;
CREATE TRIGGER api_token_ended AFTER DELETE OR UPDATE ON api_tokens
    FOR EACH ROW EXECUTE FUNCTION notify_credential_ended();
DROP TRIGGER human_changed ON humans;
CREATE TRIGGER human_changed AFTER DELETE OR UPDATE OF role, org_id, email ON humans
    FOR EACH ROW EXECUTE FUNCTION notify_human_changed();

CREATE FUNCTION notify_credentials_truncated() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('covey_credentials', '*');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER web_sessions_truncated AFTER TRUNCATE ON web_sessions
    FOR EACH STATEMENT EXECUTE FUNCTION notify_credentials_truncated();
CREATE TRIGGER api_tokens_truncated AFTER TRUNCATE ON api_tokens
    FOR EACH STATEMENT EXECUTE FUNCTION notify_credentials_truncated();
CREATE TRIGGER humans_truncated AFTER TRUNCATE ON humans
    FOR EACH STATEMENT EXECUTE FUNCTION notify_credentials_truncated();
