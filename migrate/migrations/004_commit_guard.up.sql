-- idem 004: the commit guard of group-commit batches.
--
-- A group-commit batch claims all of its keys with one statement, before any of its
-- handlers runs. A handler that ended the batch's transaction itself with COMMIT
-- would commit the claims of the messages whose handlers had not run yet, and their
-- redeliveries would be acked as duplicates with no work done. So such a
-- transaction inserts one row here, before its claim, and a deferred constraint
-- trigger on the row refuses the COMMIT unless idem's own COMMIT set idem.commit
-- (SET LOCAL, in the same round trip as its COMMIT). A COMMIT the handler sent fails
-- and rolls the whole batch back, and idem runs the batch again.
--
-- The trigger deletes the row as the transaction commits, so no row is ever left
-- committed. UNLOGGED: the rows never outlive their transaction, so they need no WAL.
-- "/* schema */" marks where idem's migrator puts the quoted schema name and a dot,
-- as in 001; the function finds the table through the trigger's own arguments.
CREATE UNLOGGED TABLE /* schema */commit_guard (
    guard boolean NOT NULL DEFAULT true
);

CREATE FUNCTION /* schema */idem_commit_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('idem.commit', true), '') <> 'on' THEN
        RAISE EXCEPTION 'idem: a handler tried to end the transaction of its group-commit batch; only idem commits it, so it is rolled back'
            USING HINT = 'Return nil from the handler to commit, an error to roll back. SET CONSTRAINTS ALL IMMEDIATE fires this check too: name your own constraints instead.';
    END IF;
    EXECUTE format('DELETE FROM %I.%I WHERE ctid = $1', TG_TABLE_SCHEMA, TG_TABLE_NAME) USING NEW.ctid;
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER commit_guard
    AFTER INSERT ON /* schema */commit_guard
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION /* schema */idem_commit_guard();
