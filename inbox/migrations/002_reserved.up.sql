-- Placeholder: version 2 is taken by the tenant-scoped effects migration, made on
-- another branch at the same time as 003. It does nothing here, and it is replaced
-- by that migration when the branches merge (delete these two files then: the
-- migrator refuses two files with one version, so it cannot be forgotten).
SELECT 1;
