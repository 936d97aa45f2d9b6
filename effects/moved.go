package effects

import (
	"context"

	"github.com/idemkit/idem/internal/effectsdb"
	"github.com/idemkit/idem/internal/errcode"
)

// The names below moved to internal/effectsdb or left the surface. They stay here
// only until the call sites follow (the rename commit deletes this file).

type (
	Source        = effectsdb.Source
	Buffer        = effectsdb.Buffer
	Item          = effectsdb.Item
	ItemErrors    = effectsdb.ItemErrors
	RequeueFilter = effectsdb.RequeueFilter
	Querier       = effectsdb.Querier
	Execer        = execer
	Error         = errcode.Error
)

var (
	NewBuffer     = effectsdb.NewBuffer
	EnqueueItems  = effectsdb.EnqueueItems
	ScopeFrom     = effectsdb.ScopeFrom
	EncodeMessage = effectsdb.EncodeMessage
	DecodeMessage = effectsdb.DecodeMessage
	TopicOf       = effectsdb.TopicOf
	RequeueDead   = effectsdb.RequeueDead
	PublishKind   = effectsdb.PublishKind
	Code          = errcode.Code
	IsPermanent   = errcode.IsPermanent
	IsIndefinite  = isIndefinite
)

func EnqueueScoped(ctx context.Context, tx Tx, scope Scope, e Effect) (Result, error) {
	r, err := effectsdb.Enqueue(ctx, tx, scope, effectsdb.Effect(e))
	return Result(r), err
}

func EnqueueManyScoped(ctx context.Context, tx Tx, scope Scope, effs []Effect) ([]Result, error) {
	return EnqueueMany(effectsdb.WithScope(ctx, scope), tx, effs)
}

func ValidateEffect(e Effect) error { return effectsdb.ValidateEffect(effectsdb.Effect(e)) }
