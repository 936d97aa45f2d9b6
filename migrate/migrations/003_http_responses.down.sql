-- Drops the stored HTTP responses (the keys stay).
ALTER TABLE /* schema */inbox
    DROP COLUMN IF EXISTS response_ref,
    DROP COLUMN IF EXISTS response_body,
    DROP COLUMN IF EXISTS response_headers,
    DROP COLUMN IF EXISTS response_status;
