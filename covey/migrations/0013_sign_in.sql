-- Failed sign-ins, counted per account and per client address (covey/sign_in.py). Keyed by a
-- hash of the email or address, known account or not: a limit that only known accounts met
-- would tell which accounts exist, as the answer's timing once did. In Postgres, not in one
-- replica's memory: spread over replicas, a guesser still meets one count.
CREATE TABLE login_failures (
    key             text PRIMARY KEY,
    failures        integer NOT NULL,
    last_failed_at  timestamptz NOT NULL
);
CREATE INDEX login_failures_last_failed_at ON login_failures (last_failed_at);

-- A session or token that ends, or a human whose role changes or who is removed, is
-- announced (whoever wrote the row: logout, an operator with psql), so that every replica ends
-- the event streams it carried at once rather than serving them to a caller who is gone.
CREATE FUNCTION notify_credential_ended() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('covey_credentials', OLD.human_id::text);
    RETURN OLD;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER web_session_ended AFTER DELETE OR UPDATE OF expires_at ON web_sessions
    FOR EACH ROW EXECUTE FUNCTION notify_credential_ended();
CREATE TRIGGER api_token_ended AFTER DELETE ON api_tokens
    FOR EACH ROW EXECUTE FUNCTION notify_credential_ended();

CREATE FUNCTION notify_human_changed() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('covey_credentials', OLD.id::text);
    RETURN OLD;
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER human_changed AFTER DELETE OR UPDATE OF role, org_id ON humans
    FOR EACH ROW EXECUTE FUNCTION notify_human_changed();
