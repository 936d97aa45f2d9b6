-- idem 005: an effect keeps the trace context of what enqueued it.
--
-- trace_context holds the W3C Trace Context of the span that was current when the
-- effect was enqueued (the consumer's handler span, or the span of an HTTP request),
-- as {"traceparent": "00-…", "tracestate": "…"}; tracestate is left out when empty.
-- The Dispatcher's send span links to it, so an email that was sent can be followed
-- back to the message that caused it. NULL when nothing was traced (the default,
-- with OpenTelemetry's no-op provider), so the column costs nothing then.
--
-- "/* schema */" marks where idem's migrator puts the quoted schema name and a dot,
-- as in 001. A migration tool of your own can apply this file as it is.
ALTER TABLE /* schema */effects
    ADD COLUMN trace_context jsonb;
