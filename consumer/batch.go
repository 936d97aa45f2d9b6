package consumer

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// BatchHandler handles the messages of a batch together, in one transaction, for
// set-based business writes (one INSERT … SELECT FROM unnest(…) for the batch). msgs
// are the messages whose keys the batch claimed, in (tenant, key) order: duplicates,
// recorded failures, mismatches and invalid messages never reach it.
//
// tx is the batch's transaction; as in a message handler, idem owns it (return nil
// to commit, an error to roll back; never end it yourself). ctx carries tx too
// (Tx(ctx)). Each message's own context (msg.Context()) carries the message's
// effects scope: effects.Enqueue(msg.Context(), tx, …) and effects.EnqueueMany add
// the message's effects, with its tenant and source, to the batch's one set-based
// write at the end. effects.Enqueue with ctx itself writes at once, with no tenant
// and no source, as from a plain transaction.
//
// Return nil when every message succeeded. To fail some messages, return an error
// that names them: ForMessage(msg, err) for each, joined with errors.Join. idem then
// rolls the batch back, answers each named message with its own error (a permanent
// one, consumer.Permanent, is recorded as that message's failure alone), and runs
// the batch handler again with the others. Name every failing message in one
// error, so that one run more suffices. An error that names no message (or a
// panic) cannot be pinned on one: idem isolates the culprits by bisection, running
// the handler on halves of msgs, each in a savepoint of its own, and halving the
// ones that fail until single messages fail alone (about 2·log2(n) runs for one
// poison message among n). An error that names a message that is not in msgs is a
// bug: every message of that call is nacked with ErrMessageNotInBatch, and none is
// recorded. A batch handler may so run more than once for a message; only its
// database work counts, and it commits once. A batch handler that ends the
// transaction has every message of that call recorded as failed (ErrTxEnded).
type BatchHandler func(ctx context.Context, tx pgx.Tx, msgs []*message.Message) error

// messageError names the message of a batch that an error belongs to
// (ForMessage). Its code and permanence are Err's.
type messageError struct {
	Msg *message.Message
	Err error
}

// ForMessage says that err is msg's failure alone, for a BatchHandler to return
// (several joined with errors.Join). msg must be one of the messages of the call
// that returns it (else ErrMessageNotInBatch). A nil err stays nil.
func ForMessage(msg *message.Message, err error) error {
	if err == nil {
		return nil
	}
	return &messageError{Msg: msg, Err: err}
}

func (e *messageError) Error() string {
	id := "<nil>"
	if e.Msg != nil {
		id = e.Msg.UUID
	}
	return fmt.Sprintf("message %s: %v", id, e.Err)
}

// Unwrap returns the message's own error.
func (e *messageError) Unwrap() error { return e.Err }

// pinned maps the messageErrors in err to the batch indexes of the messages they
// name (index). One that names a message outside index makes foreign
// ErrMessageNotInBatch, with err's text but not its chain: a permanent error about
// a message that is not there must not record the innocent ones as failed.
func pinned(err error, index map[*message.Message]int) (named map[int]error, foreign error) {
	named = map[int]error{}
	for _, me := range messageErrors(err) {
		i, ok := index[me.Msg]
		if !ok {
			return nil, fmt.Errorf("%w: %v", ErrMessageNotInBatch, err)
		}
		if _, twice := named[i]; !twice {
			named[i] = cmp.Or(me.Err, errors.New("idem: a batch handler named a message without an error"))
		}
	}
	return named, nil
}

// messageErrors returns the messageErrors in err's tree, without looking inside them.
func messageErrors(err error) []*messageError {
	var out []*messageError
	var walk func(error)
	walk = func(err error) {
		switch e := err.(type) { //nolint:errorlint // it walks the tree itself, to stop at each messageError
		case nil:
		case *messageError:
			out = append(out, e)
		case interface{ Unwrap() []error }:
			for _, inner := range e.Unwrap() {
				walk(inner)
			}
		case interface{ Unwrap() error }:
			walk(e.Unwrap())
		}
	}
	walk(err)
	return out
}
