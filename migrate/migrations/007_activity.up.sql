-- idem 007: the indexes of the activity charts (the operator API's Activity, the
-- console's overview).
--
-- "/* schema */" marks where idem's migrator puts the quoted schema name and a dot,
-- as in 001. A migration tool of your own can apply this file as it is.
--
-- The charts count, per minute over the last hour or day, the inbox keys settled
-- (completed or failed) and the effects that went dead. Each count is one range
-- of one of these indexes, an index-only scan from the window's start, so it costs
-- the rows of the window, never the table. (Effects sent are counted through
-- effects_done_at_idx, which exists already.)
--
-- inbox_settled_at_idx holds every settled key, so each claim writes one more index
-- entry. effects_dead_at_idx holds the dead effects only.
--
-- Building an index reads the whole table under the migration's lock. On a big
-- table, build these two first with CREATE INDEX CONCURRENTLY and the same
-- definitions: IF NOT EXISTS then skips them here.
CREATE INDEX IF NOT EXISTS inbox_settled_at_idx ON /* schema */inbox (completed_at, state)
    WHERE state IN ('completed', 'failed');
CREATE INDEX IF NOT EXISTS effects_dead_at_idx ON /* schema */effects (dead_at)
    WHERE state = 'dead';
