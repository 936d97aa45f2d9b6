-- Reverts 004. Binaries that run set-based group commit need the guard: deploy one
-- that does not before going back.
DROP TABLE IF EXISTS /* schema */commit_guard;
DROP FUNCTION IF EXISTS /* schema */idem_commit_guard();
