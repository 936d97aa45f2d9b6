-- Reverts 005: the effects lose the trace context of what enqueued them (the
-- effects themselves stay).
ALTER TABLE /* schema */effects
    DROP COLUMN IF EXISTS trace_context;
