-- Reverts 007: drops the indexes of the activity charts (no data is lost).
DROP INDEX IF EXISTS /* schema */effects_dead_at_idx;
DROP INDEX IF EXISTS /* schema */inbox_settled_at_idx;
