package effectsdb

import (
	"context"
	"encoding/json"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// w3c is the form effect rows keep trace context in, whatever propagator the
// application uses: the column is for idem to read back, and W3C Trace Context is
// understood by every tracing backend.
var w3c = propagation.TraceContext{}

// EncodeTrace returns sc as the JSON an effect row keeps ({"traceparent": …,
// "tracestate": …}), or "" when sc is not valid (the row keeps NULL then).
func EncodeTrace(sc trace.SpanContext) string {
	if !sc.IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	w3c.Inject(trace.ContextWithSpanContext(context.Background(), sc), c)
	b, err := json.Marshal(map[string]string(c))
	if err != nil {
		return ""
	}
	return string(b)
}

// DecodeTrace reads what EncodeTrace wrote back into a remote span context; an
// empty or unreadable value gives an invalid one.
func DecodeTrace(s string) trace.SpanContext {
	if s == "" {
		return trace.SpanContext{}
	}
	var c map[string]string
	if err := json.Unmarshal([]byte(s), &c); err != nil {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(w3c.Extract(context.Background(), propagation.MapCarrier(c)))
}
