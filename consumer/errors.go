package consumer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/errcode"
)

// Re-exported errors of other idem packages (the same values), so handler code
// needs one import.
var (
	// ErrFingerprintMismatch is returned when a key comes again with a different
	// payload fingerprint (inbox.ErrFingerprintMismatch).
	ErrFingerprintMismatch = inbox.ErrFingerprintMismatch
	// ErrEmptyKey is returned when a message gives no key (inbox.ErrEmptyKey).
	// The middleware's error wraps it with what to configure (see errNoKey).
	ErrEmptyKey = inbox.ErrEmptyKey
	// ErrKeyTooLong is returned when a key is longer than inbox.MaxKeyLen bytes
	// (inbox.ErrKeyTooLong).
	ErrKeyTooLong = inbox.ErrKeyTooLong
	// ErrKeyInvalid is returned when a key is not UTF-8 or holds a NUL byte
	// (inbox.ErrKeyInvalid).
	ErrKeyInvalid = inbox.ErrKeyInvalid
	// ErrNotJSON is returned when a payload is not JSON under a canonical-JSON
	// fingerprint (inbox.ErrNotJSON).
	ErrNotJSON = inbox.ErrNotJSON
	// ErrSchemaMissing is returned when the idem tables, or a column a newer
	// migration adds, are not in the schema (inbox.ErrSchemaMissing); the message
	// is nacked.
	ErrSchemaMissing = inbox.ErrSchemaMissing
	// ErrInvalidConfig is wrapped by the error New returns for a config it refuses
	// (code "invalid_config"), unless a more specific sentinel says what is wrong
	// (such as inbox.ErrInvalidSchema). Every idem package has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig
)

// Error is an idem error with a stable code. Compare with errors.Is against the
// sentinels. It is the one coded error type of every idem package (inbox.Error and
// inbox.Error are the same type).
type Error = errcode.Error

var (
	// ErrBusy is returned when another delivery of the same key is running right
	// now and did not finish within LockTimeout (or holds a fresh lease). The
	// message is nacked after BusyDelay; the redelivery finds the other delivery's
	// result.
	ErrBusy = errcode.Transient("busy", "another delivery of this key is in progress; nacked to retry later")
	// ErrCommitUnknown is returned when COMMIT failed, so whether it happened is
	// unknown (for example the connection was cut mid-commit). The message is
	// nacked and the inbox settles it on redelivery: the row is there (a duplicate)
	// or not (run again).
	ErrCommitUnknown = errcode.Transient("commit_unknown", "commit outcome unknown; nacked so the redelivery settles it")
	// ErrNoPublishTopic is returned when the handler returned messages but the
	// Watermill handler has no publish topic to store them for.
	ErrNoPublishTopic = errcode.Permanent("no_publish_topic", "handler returned messages, but the router handler has no publish topic")
	// ErrNoName is returned when the consumer has no Name and the context has no
	// handler name.
	ErrNoName = errcode.Transient("no_consumer_name", "consumer has no Name and the message context names no Watermill handler")
	// ErrTxOwned is returned when the handler called Commit or Rollback on the
	// transaction idem gave it. Return nil to commit and an error to roll back.
	ErrTxOwned = errcode.Transient("tx_owned", "the handler's transaction belongs to idem: return nil to commit, an error to roll back")
	// ErrExpiredRetry is returned when the message is older than the consumer's
	// retention, so its inbox row may be gone. Returned only with ExpiredRetryFail.
	ErrExpiredRetry = errcode.Permanent("expired_retry", "message is older than the inbox retention")
	// ErrTxEnded is returned when the handler ended idem's transaction itself, with
	// raw SQL such as tx.Exec(ctx, "COMMIT") or "ROLLBACK" (perhaps followed by a
	// BEGIN). Statements after that ran outside idem's transaction, each committing
	// on its own, so running the handler again could write them twice. idem commits
	// nothing more in that transaction, gives its connection back, and records the
	// key as a permanent failure with this code in a fresh transaction, in every
	// mode: no redelivery runs the handler again (a redelivery is a replayed
	// failure, or a duplicate if the handler's own COMMIT committed the key's row).
	// The delivery is answered as any recorded failure (acked, or a FailedError
	// with PoisonOnPermanent; OnFailure and idem_inbox_failed_total see it). In a
	// batch, the key of the handler that did it is recorded (for a BatchHandler,
	// every message of the call that did it); its neighbours are run again or
	// nacked. Never end idem's transaction yourself: return an error to roll back.
	ErrTxEnded = errcode.Permanent("handler_ended_transaction", "the handler ended idem's transaction itself (raw COMMIT or ROLLBACK); the key is recorded as failed; return an error to roll back instead")
	// ErrTxAborted is returned when a statement of the handler's transaction failed
	// but the handler returned nil (did it swallow an error, such as a unique
	// violation?). Postgres rolls such a transaction back, so the message is
	// nacked. Catch expected errors inside a savepoint (tx.Begin), or use ON
	// CONFLICT.
	ErrTxAborted = errcode.Transient("tx_aborted", "a statement in the handler's transaction failed but the handler returned nil; rolled back and nacked")
	// ErrBatchAborted is returned, in GroupCommit mode, when another message of the
	// same batch broke the shared transaction (its error is in this one's text), so
	// nothing of the batch is committed by idem and this message is nacked. Its
	// redelivery finds its inbox row or runs it again.
	ErrBatchAborted = errcode.Transient("batch_aborted", "another message of this group-commit batch broke the shared transaction; nacked")
	// ErrMessageNotInBatch is returned when a BatchHandler returned an error that
	// names (ForMessage) a message that is not one of the messages it was given.
	// That is a bug in the handler, and idem cannot tell which message failed, so
	// every message of that call is nacked with this code (logged at error level)
	// and nothing is recorded for any of them; the redelivery runs them again.
	ErrMessageNotInBatch = errcode.Transient("message_not_in_batch", "the batch handler named a message that is not in the batch it was given; a bug in the handler: nacked, nothing recorded")
	// ErrCanceled is returned when the message's context was cancelled (a Kafka
	// partition revoked, a router shutting down) before idem sent COMMIT, so
	// nothing was committed and the message is nacked. A COMMIT already sent is
	// never cancelled.
	ErrCanceled = errcode.Transient("canceled", "the message's context was cancelled before COMMIT was sent; nothing was committed; nacked")
	// ErrClosed is returned when the consumer was closed, so it takes no more
	// messages; they are nacked. Close the router before the consumer.
	ErrClosed = errcode.Transient("closed", "consumer closed; nacked")
	// ErrDatabaseUnavailable is returned when Postgres could not be reached or
	// refused the connection, or the connection broke (a restart, a failover, a
	// terminated backend, a network cut) before idem sent COMMIT, so the delivery's
	// transaction did not commit and the message is nacked; its redelivery runs it
	// again. It wraps the driver's error, which errors.As still finds. A connection
	// that breaks during COMMIT is ErrCommitUnknown instead.
	ErrDatabaseUnavailable = errcode.Transient("database_unavailable", "Postgres is unreachable or the connection to it broke before COMMIT; nothing of the delivery's transaction committed; nacked")
	// ErrBusinessKey is returned when the BusinessKey function failed, so the
	// message has no key. It is permanent (retrying cannot help) but cannot be
	// recorded in the inbox, because there is no key to record it under: the
	// message is returned as an error, and is redelivered forever unless a
	// middleware.PoisonQueue outside idem takes it. On Kafka a message redelivered
	// forever stalls its partition.
	ErrBusinessKey = errcode.Permanent("business_key", "the business key function failed: no key, so the failure cannot be recorded; poison the message")
)

// ErrTenantMissing is returned for a message without a tenant (Tenant gave "")
// when the consumer's Shards route by tenant and no DefaultTenant is set: it is
// never routed by the empty tenant. It is permanent, with httpidem's code for the
// same request ("tenant_invalid"), and cannot be recorded (no shard is its own):
// nothing is claimed, and the message is returned as an error, poisoned by a
// PoisonQueue filtered on IsPermanent outside idem, or nacked. Give the message its
// tenant, or set Config.DefaultTenant.
var ErrTenantMissing = errcode.Permanent("tenant_invalid", "the message has no tenant, and the consumer's Shards route by tenant; nothing was claimed: "+
	"give the message its tenant, or set Config.DefaultTenant")

// ErrNoTx is what Tx panics with, and TxSafely returns, for a context without
// idem's transaction: the consumer's Middleware is not around the handler, or the
// middleware that asks is outside idem's (added before it), or the context is not
// the message's. It is transient: a handler that returns it is nacked, not
// recorded.
var ErrNoTx = errcode.Transient("no_transaction", "no idem transaction in this context: the consumer's Middleware is not around this handler, or the code asking runs outside it; "+
	"add c.Middleware last in AddMiddleware (innermost), and read Tx from the message's context (msg.Context())")

// ErrMiddlewareOrder is returned for every message when a middleware that calls
// the handler again or turns its failure into success (Watermill's Retry,
// Duplicator, PoisonQueue, IgnoreErrors) runs between idem's middleware and the
// handler. Inside idem, every attempt of a Retry runs in idem's one transaction, so
// a failed attempt's writes would commit with the next one's; a PoisonQueue would
// make idem commit a failed handler's partial writes and record the key as done.
// Nothing runs and nothing is recorded: the message is nacked (logged once at
// error level) until the order is fixed. Put idem last, innermost:
// AddMiddleware(poison, retry.Middleware, c.Middleware). See docs/consumers.md.
var ErrMiddlewareOrder = errcode.Transient("middleware_order", "a middleware that calls the handler again or swallows its errors (Retry, PoisonQueue, IgnoreErrors, Duplicator) is inside idem's middleware; "+
	"add it before idem, so idem is innermost: AddMiddleware(poison, retry.Middleware, c.Middleware); nacked, nothing committed")

// errNoKey is the middleware's error for a message whose Key function gave the
// empty key: it wraps ErrEmptyKey (code "empty_key", permanent) and says what to
// configure. It is the one text of that mistake, whatever the broker.
var errNoKey = fmt.Errorf("%w: the message gave no key. The default Key is the message UUID, "+
	"which is empty for a message from a producer that sets none (a Kafka record without the "+
	"_watermill_message_uuid header, a NATS message without Nats-Msg-Id). "+
	"Set Config.Key to a key the message carries: consumer.BusinessKey (from the payload), "+
	"consumer.MetadataKey (from a header), or the record's position (kafka.PartitionOffsetKey; "+
	"on NATS, consumer.MetadataKey(nats.MetadataStreamSeq)); "+
	"and put a middleware.PoisonQueue outside idem's middleware, or the message is redelivered "+
	"forever (on Kafka it holds its partition)", ErrEmptyKey)

// PermanentError marks a handler failure that retrying cannot fix: a validation
// error, an undecodable payload, a business rule. The consumer rolls the work back,
// records the key as failed, and acks (or poisons) instead of nacking.
type PermanentError struct {
	Err error
}

// Permanent wraps err as a permanent failure. A nil err stays nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent reports true: retrying the message cannot succeed.
func (e *PermanentError) Permanent() bool { return true }

// Code is the wrapped error's code, or "permanent".
func (e *PermanentError) Code() string {
	if c := Code(e.Err); c != "" {
		return c
	}
	return "permanent"
}

// IsPermanent reports whether err is a permanent failure: marked with Permanent, or
// an idem validation error (bad key, non-JSON payload, mismatch, bad effect).
func IsPermanent(err error) bool { return errcode.IsPermanent(err) }

// Code returns the stable code of the first coded error in err's chain, or "".
func Code(err error) string { return errcode.Code(err) }

// FailedError is returned, under PoisonOnPermanent, for a permanent failure that
// was recorded in the inbox, so that a PoisonQueue placed outside can route it.
type FailedError struct {
	Consumer, Tenant, Key string
	// Replayed: the failure was recorded by an earlier delivery.
	Replayed bool
	Err      error
}

func (e *FailedError) Error() string {
	return fmt.Sprintf("idem: consumer %q key %q failed permanently: %v", e.Consumer, e.Key, e.Err)
}
func (e *FailedError) Unwrap() error { return e.Err }

// Permanent reports true: the failure is recorded, and a retry only replays it.
func (e *FailedError) Permanent() bool { return true }

// ShouldRetry is for middleware.Retry's ShouldRetry field: it retries transient
// errors only. A permanent failure is recorded already; retrying it would only
// replay the record.
func ShouldRetry(p middleware.RetryParams) bool { return !IsPermanent(p.Err) }

// connectionLost reports whether err says that Postgres could not be reached, or
// that the connection to it broke: a FATAL error (the server ended the session),
// a Postgres error of class 08 (connection exception), a server shutting down or
// starting (57P01, 57P02, 57P03), too many connections (53300), a failed connect,
// a network error or an end of stream, or pgx refusing a connection that is
// already closed. A cancelled context is not one (it is ErrCanceled).
func connectionLost(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		if pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC" {
			return true // the server ended the session (an idle-in-transaction timeout, say)
		}
		switch pgErr.Code {
		case pgerrcode.AdminShutdown, pgerrcode.CrashShutdown, pgerrcode.CannotConnectNow, pgerrcode.TooManyConnections:
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08")
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	switch {
	case errors.As(err, &connectErr), errors.As(err, &netErr),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.EPIPE),
		errors.Is(err, pgconn.ErrConnClosed):
		return true
	}
	// pgx's error for a statement sent on a connection it has closed after a
	// failure has no exported type; SafeToRetry marks it (nothing was sent).
	return pgconn.SafeToRetry(err) && strings.Contains(err.Error(), "conn closed")
}
