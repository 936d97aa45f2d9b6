-- idem core schema: the inbox and the effects tables.
--
-- "/* schema */" marks where idem's migrator puts the quoted schema name and a dot
-- (for example "idem".). A migration tool of your own can apply this file as it is:
-- the marker is a comment, so the tables land in the first schema of search_path.

CREATE TABLE /* schema */inbox (
    consumer      text        NOT NULL,
    tenant        text        NOT NULL DEFAULT '',
    key           text        NOT NULL,
    fingerprint   bytea       NOT NULL,
    state         text        NOT NULL CHECK (state IN ('processing', 'completed', 'failed')),
    error_code    text,
    error         text,
    attempts      integer     NOT NULL DEFAULT 1,
    lease_until   timestamptz,
    fence         bigint      NOT NULL DEFAULT 0,
    received_at   timestamptz NOT NULL DEFAULT now(),
    completed_at  timestamptz,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (consumer, tenant, key)
);

-- The janitor deletes settled rows by age and never looks at processing ones.
CREATE INDEX inbox_expires_at_idx ON /* schema */inbox (expires_at)
    WHERE state IN ('completed', 'failed');

CREATE TABLE /* schema */effects (
    kind             text        NOT NULL,
    key              text        NOT NULL,
    payload          bytea,
    fingerprint      bytea       NOT NULL,
    state            text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'done', 'dead')),
    attempts         integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL DEFAULT 25 CHECK (max_attempts > 0),
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    fence            bigint      NOT NULL DEFAULT 0,
    -- in_flight is true from a claim until its outcome is recorded. A claim that finds
    -- it still true knows the previous attempt's outcome is unknown (its lease ran out).
    in_flight        boolean     NOT NULL DEFAULT false,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    done_at          timestamptz,
    source_consumer  text,
    source_tenant    text,
    source_key       text,
    PRIMARY KEY (kind, key)
);

-- Due work, for the dispatcher's claim.
CREATE INDEX effects_due_idx ON /* schema */effects (next_attempt_at)
    WHERE state = 'pending';

-- Old done effects, for the janitor.
CREATE INDEX effects_done_at_idx ON /* schema */effects (done_at)
    WHERE state = 'done';

-- The effects a message made, for inspect.
CREATE INDEX effects_source_idx ON /* schema */effects (source_consumer, source_tenant, source_key)
    WHERE source_consumer IS NOT NULL;

-- Wake dispatchers when new effects commit. NOTIFY is delivered at commit, and
-- Postgres folds identical notifications of one transaction into one, so a batch of
-- inserts costs one notification. The payload is the schema, so one channel serves
-- every schema in the database. Claims and retries do not notify (they would wake
-- every dispatcher for nothing); a requeue or a released claim notifies itself.
CREATE FUNCTION /* schema */idem_effects_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_effects', TG_TABLE_SCHEMA);
    RETURN NULL;
END;
$$;

CREATE TRIGGER effects_notify
    AFTER INSERT ON /* schema */effects
    FOR EACH STATEMENT EXECUTE FUNCTION /* schema */idem_effects_notify();
