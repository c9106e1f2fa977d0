-- A switch's flag in one round trip (covey/switches.py, `_flag`): its locks, then its one
-- statement, committed by the call itself. As three round trips (BEGIN with the locks, the
-- statement, COMMIT) the flag was most of a single kill's time to its daemon, and under
-- incident load each of them waited its turn on a busy event loop and a busy database.
--
-- The statement must run after the locks, on a snapshot taken once they are held: a wake
-- that committed a session while the kill waited for the agent's row is seen, and that
-- session cancelled. One plain statement cannot do it (its snapshot is taken before it
-- waits); a VOLATILE PL/pgSQL function takes a new snapshot for each statement it runs
-- (READ COMMITTED). The locks and the statement come from the caller, with the switch's
-- values as parameters $1..$6 of both: the two kills' (agent, fleet) share this shape.
CREATE FUNCTION covey_switch_flag(locks text[], body text, p1 uuid, p2 uuid, p3 uuid,
                                  p4 text, p5 text, p6 text)
RETURNS TABLE (what text, id uuid, agent_id uuid, sandbox_id uuid, flag boolean,
               origin text, actor text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    lock text;
    -- Named by the statement and the schema: a migration that changes a column's type
    -- makes a statement prepared before it unusable ("cached plan must not change result
    -- type") on every connection that holds it.
    prepared text := 'covey_switch_flag_' || md5(body || (SELECT max(name) FROM schema_migrations));
BEGIN
    FOREACH lock IN ARRAY locks LOOP
        EXECUTE lock USING p1, p2, p3, p4, p5, p6;
    END LOOP;
    -- Prepared once per connection and switch: planning a statement of a dozen CTEs cost
    -- more than running it. (A prepared statement's parameters cannot come through USING:
    -- they are quoted by format's %L.)
    IF NOT EXISTS (SELECT 1 FROM pg_prepared_statements WHERE name = prepared) THEN
        EXECUTE format('PREPARE %I (uuid, uuid, uuid, text, text, text) AS %s',
                       prepared, body);
    END IF;
    RETURN QUERY EXECUTE format('EXECUTE %I (%L, %L, %L, %L, %L, %L)',
                                prepared, p1, p2, p3, p4, p5, p6);
END;
$$;
