-- HTTP Idempotency-Key responses (package httpidem).
--
-- An HTTP request's key is an inbox row like a message's: consumer is the operation
-- ("POST /payments"), tenant the principal's scope. Its final response is stored on
-- the same row, in the same transaction as the handler's work, so that a retry gets
-- it back byte for byte, and the janitor deletes it with the key. Message consumers
-- leave these columns NULL.
--
-- Nullable columns without a default: adding them changes only the catalog, with
-- no rewrite or scan of the table, however many rows it has.

ALTER TABLE /* schema */inbox
    -- the status code, 100..599
    ADD COLUMN response_status  smallint,
    -- the stored headers, as HTTP/1.1 header lines "Name: value\r\n", sorted by name
    -- (bytea: header values may hold bytes that are not UTF-8)
    ADD COLUMN response_headers bytea,
    -- the body; NULL when response_ref is set
    ADD COLUMN response_body    bytea,
    -- a reference the application resolves to the body on a replay, instead of
    -- storing a body that holds personal data
    ADD COLUMN response_ref     text;
