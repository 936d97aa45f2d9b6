-- idem 006: failure groups, discarded effects and the audit of repair actions.
--
-- "/* schema */" marks where idem's migrator puts the quoted schema name and a dot,
-- as in 001. A migration tool of your own can apply this file as it is.
--
-- A failed inbox key and a dead effect keep, beside their error, the error text with
-- its variable parts masked (error_masked) and the ID of their failure group
-- (error_group): the first 8 bytes of a SHA-256 over the consumer or kind, the
-- tenant, the error code and the masked text. The code that records the failure
-- fills both, so listing the groups is a GROUP BY over an index, never a pass over
-- the error texts. Rows that failed before this migration have NULL there: the
-- operator API fills them in small batches the first time it reads the groups
-- (masking is Go code, and one implementation serves both), so this migration never
-- rewrites a row.
--
-- Every column below is nullable without a default: adding it changes the catalog
-- only, with no rewrite or scan of the table.
ALTER TABLE /* schema */inbox
    ADD COLUMN error_masked text,
    ADD COLUMN error_group  bytea;

ALTER TABLE /* schema */effects
    -- the stable code of the error that made the effect dead, when it had one
    ADD COLUMN error_code   text,
    ADD COLUMN error_masked text,
    ADD COLUMN error_group  bytea,
    -- when the effect went dead
    ADD COLUMN dead_at      timestamptz;

-- discarded: an operator settled a dead effect without sending it. It is never
-- claimed, and the janitor deletes it after the retention of done effects, counted
-- from done_at (the time it was settled, done or discarded). The new CHECK allows
-- more than the old one, so every row already satisfies it: NOT VALID skips the scan
-- that would prove it, and new rows are checked all the same.
ALTER TABLE /* schema */effects
    DROP CONSTRAINT effects_state_check,
    ADD CONSTRAINT effects_state_check CHECK (state IN ('pending', 'done', 'dead', 'discarded')) NOT VALID;

-- The groups of failed keys and dead effects, and the rows of one group: a group's
-- rows are one range of these indexes, and the list of groups reads only them (an
-- index-only scan, in group order). Partial: the completed keys and the pending or
-- done effects, nearly all rows, are not in them.
--
-- Building an index reads the whole table under the migration's lock. On a big
-- table, build these three first with CREATE INDEX CONCURRENTLY and the same
-- definitions (after adding the columns above): IF NOT EXISTS then skips them here.
CREATE INDEX IF NOT EXISTS inbox_failure_group_idx ON /* schema */inbox (error_group, consumer, tenant, completed_at)
    WHERE state = 'failed';
CREATE INDEX IF NOT EXISTS effects_failure_group_idx ON /* schema */effects (error_group, kind, tenant, dead_at)
    INCLUDE (attempts) WHERE state = 'dead';
-- Old discarded effects, for the janitor.
CREATE INDEX IF NOT EXISTS effects_discarded_idx ON /* schema */effects (done_at)
    WHERE state = 'discarded';

-- One row per repair action taken on a failure group (retry, discard, release):
-- who, why, what, when, and how many rows it changed (affected). Dry runs are not recorded.
CREATE TABLE /* schema */failure_actions (
    id        uuid        NOT NULL DEFAULT gen_random_uuid() PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    action    text        NOT NULL CHECK (action IN ('retry', 'discard', 'release')),
    -- the group: inbox (failed keys of a consumer) or effects (dead effects of a kind)
    source    text        NOT NULL CHECK (source IN ('inbox', 'effects')),
    group_id  bytea       NOT NULL,
    place     text        NOT NULL,
    tenant    text        NOT NULL,
    -- the snapshot bound: only the group's rows that failed at or before it
    through   timestamptz NOT NULL,
    affected  bigint      NOT NULL,
    who       text        NOT NULL,
    why       text        NOT NULL
);

CREATE INDEX failure_actions_at_idx ON /* schema */failure_actions (at, id);
CREATE INDEX failure_actions_group_idx ON /* schema */failure_actions (group_id, at, id);
