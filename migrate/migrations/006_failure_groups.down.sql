-- Reverts 006: drops the audit of repair actions and the failure groups' columns.
-- It refuses, and changes nothing, while any effect is discarded: the old CHECK
-- cannot hold it.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM /* schema */effects WHERE state = 'discarded') THEN
        RAISE EXCEPTION 'idem: cannot revert migration 006: some effects are discarded, a state the older schema does not have'
            USING HINT = 'Delete the discarded effects first (DELETE FROM effects WHERE state = ''discarded''), or stay on migration 006.';
    END IF;
END;
$$;

DROP TABLE IF EXISTS /* schema */failure_actions;

DROP INDEX IF EXISTS /* schema */effects_discarded_idx;
DROP INDEX IF EXISTS /* schema */effects_failure_group_idx;
DROP INDEX IF EXISTS /* schema */inbox_failure_group_idx;

ALTER TABLE /* schema */effects
    DROP CONSTRAINT effects_state_check,
    ADD CONSTRAINT effects_state_check CHECK (state IN ('pending', 'done', 'dead')) NOT VALID;

ALTER TABLE /* schema */effects
    DROP COLUMN IF EXISTS dead_at,
    DROP COLUMN IF EXISTS error_group,
    DROP COLUMN IF EXISTS error_masked,
    DROP COLUMN IF EXISTS error_code;

ALTER TABLE /* schema */inbox
    DROP COLUMN IF EXISTS error_group,
    DROP COLUMN IF EXISTS error_masked;
