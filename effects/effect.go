package effects

import (
	"context"

	"github.com/idemkit/idem/internal/effectsdb"
)

// The rename step's stand-ins, until the call sites follow: the rename commit
// writes the public Effect, Result, Scope and WithScope in this file.
type (
	Effect = effectsdb.Effect
	Result = effectsdb.Result
	Scope  = effectsdb.Scope
)

// WithScope returns a context that carries s for Enqueue.
func WithScope(ctx context.Context, s Scope) context.Context { return effectsdb.WithScope(ctx, s) }
