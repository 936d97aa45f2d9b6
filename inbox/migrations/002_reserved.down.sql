-- Placeholder for version 2; see 002_reserved.up.sql.
SELECT 1;
