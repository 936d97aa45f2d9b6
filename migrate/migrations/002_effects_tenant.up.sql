-- idem 002: effects are scoped by tenant, outcome writes are idempotent, and the
-- claim's index leads with the kind.
--
-- "/* schema */" marks where idem's migrator puts the quoted schema name and a dot,
-- as in 001. A migration tool of your own can apply this file as it is.
--
-- tenant: an effect's identity is (tenant, kind, key); '' when unscoped. Two tenants'
-- "receipt:123" are two effects.
-- recorded_fence: the fence of the claim whose outcome was recorded last. An
-- outcome write retried after its COMMIT reply was lost finds its own fence there
-- and changes nothing, instead of applying twice.
ALTER TABLE /* schema */effects
    ADD COLUMN tenant         text   NOT NULL DEFAULT '',
    ADD COLUMN recorded_fence bigint NOT NULL DEFAULT 0;

-- Effects that a tenant-scoped consumer made before this migration belong to that
-- tenant, so a redelivery enqueues into the same row.
UPDATE /* schema */effects SET tenant = source_tenant
    WHERE source_tenant IS NOT NULL AND source_tenant <> '';

ALTER TABLE /* schema */effects
    DROP CONSTRAINT effects_pkey,
    ADD PRIMARY KEY (tenant, kind, key);

-- Due work, for the dispatcher's claim, which asks for the oldest due effects of one
-- kind at a time: (kind, next_attempt_at) serves that as one index range scan in
-- order, whatever the table's statistics say, and never walks past the due effects
-- of kinds that nobody is sending.
DROP INDEX /* schema */effects_due_idx;
CREATE INDEX effects_due_idx ON /* schema */effects (kind, next_attempt_at)
    WHERE state = 'pending';
