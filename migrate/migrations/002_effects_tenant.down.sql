-- Reverts 002. It refuses, and changes nothing, when going back would merge or lose
-- effects: two tenants holding the same (kind, key), or a tenant that source_tenant
-- does not also hold (an effect enqueued with a tenant outside a consumer).
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM /* schema */effects GROUP BY kind, key HAVING count(*) > 1) THEN
        RAISE EXCEPTION 'idem: cannot revert migration 002: several tenants have effects with the same kind and key, and the old primary key (kind, key) cannot hold them'
            USING HINT = 'Delete or rename the effects of one tenant first, or stay on migration 002.';
    END IF;
    IF EXISTS (SELECT 1 FROM /* schema */effects WHERE tenant <> coalesce(source_tenant, '')) THEN
        RAISE EXCEPTION 'idem: cannot revert migration 002: some effects have a tenant that source_tenant does not record, and it would be lost'
            USING HINT = 'Stay on migration 002, or copy the tenant column somewhere first.';
    END IF;
END;
$$;

ALTER TABLE /* schema */effects
    DROP CONSTRAINT effects_pkey,
    ADD PRIMARY KEY (kind, key);

DROP INDEX /* schema */effects_due_idx;
CREATE INDEX effects_due_idx ON /* schema */effects (next_attempt_at)
    WHERE state = 'pending';

ALTER TABLE /* schema */effects
    DROP COLUMN recorded_fence,
    DROP COLUMN tenant;
