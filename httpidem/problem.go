package httpidem

import (
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/idemkit/idem/internal/errcode"
)

// What a client reads in idem's answers: the header that marks a replay, and the
// problem codes, the stable "code" member of idem's RFC 9457 answers (and the
// type's last part). Clients and dashboards match on these, never on the text.
const (
	// ReplayedHeader marks a replayed response: "Idempotent-Replayed: true".
	ReplayedHeader = "Idempotent-Replayed"
	// ProblemTypePrefix starts the "type" of every problem idem answers with; the
	// code follows it ("urn:idem:problem:fingerprint_mismatch").
	ProblemTypePrefix = "urn:idem:problem:"

	// CodeKeyMissing (400): the route requires the key header and it is absent.
	CodeKeyMissing = "idempotency_key_missing"
	// CodeKeyInvalid (400): the key is empty, over 512 bytes, not UTF-8, sent
	// twice, or a malformed quoted string.
	CodeKeyInvalid = "idempotency_key_invalid"
	// CodeTenantInvalid (400): Config.Tenant failed or gave an invalid tenant.
	CodeTenantInvalid = "tenant_invalid"
	// CodeBodyNotJSON (400): the body says it is JSON and is not (duplicate member
	// names included), so it cannot be fingerprinted.
	CodeBodyNotJSON = "body_not_json"
	// CodeFingerprintFailed (400): Config.Fingerprint returned an error.
	CodeFingerprintFailed = "fingerprint_failed"
	// CodeBodyUnreadable (400): reading the request body failed.
	CodeBodyUnreadable = "request_body_unreadable"
	// CodeRequestTooLarge (413): the body is over Config.MaxRequestBody; nothing ran.
	CodeRequestTooLarge = "request_too_large"
	// CodeFingerprintMismatch (422): the key was used with a different request.
	CodeFingerprintMismatch = "fingerprint_mismatch"
	// CodeInProgress (409, Retry-After): a request with the same key is running.
	CodeInProgress = "request_in_progress"
	// CodeResponseTooLarge (500): the handler wrote more than MaxResponseBody; its
	// work was rolled back.
	CodeResponseTooLarge = "response_too_large"
	// CodeTransactionEnded (500): the handler's transaction cannot commit and
	// nothing of the request committed, so nothing is stored and a retry runs it
	// again: a statement failed in it and the handler answered a success anyway (a
	// final client error answered past it is stored as any other); or, on a route without a key, the handler ended it with raw SQL (a
	// keyed request is settled instead: CodeHandlerCommitted,
	// CodeHandlerEndedTransaction); or the key of a handler that ended it could not
	// be recorded.
	CodeTransactionEnded = "transaction_ended"
	// CodeHandlerCommitted (500): the handler committed the transaction idem gave
	// it with raw SQL, so the key and the work done before that COMMIT committed
	// without an answer, and any transaction the handler began after it was rolled
	// back. This answer is stored for the key (a completed row): every retry gets it
	// again (replayed), and the request never runs again. Fix the handler; never end
	// the transaction Tx(ctx) gives.
	CodeHandlerCommitted = "handler_committed"
	// CodeHandlerEndedTransaction (500): the handler ended the transaction idem gave
	// it with raw SQL (ROLLBACK, perhaps followed by a BEGIN) and its claim did not
	// commit: what it wrote before was rolled back, and what it wrote after, outside
	// idem's transaction, committed on its own, so running it again could write that
	// twice. This answer is stored for the key (a failed row, the code message
	// consumers record for the same mistake): every retry gets it again (replayed),
	// and the request never runs again. Fix the handler; never end the transaction
	// Tx(ctx) gives.
	CodeHandlerEndedTransaction = "handler_ended_transaction"
	// CodeNoOperation (500): the request has no operation: Route.Operation is not
	// set, Config.Operation is not set and the request has no http.ServeMux
	// pattern (the middleware wraps the mux, not each route's handler), or
	// Config.Operation failed.
	CodeNoOperation = "operation_unknown"
	// CodeResponseNotStored (500): the key has a row without a stored response
	// (a message consumer shares the operation's name, migration 003 came after the
	// row, or a handler committed the request's transaction itself and the server
	// stopped before it could store the handler_committed answer).
	CodeResponseNotStored = "response_not_stored"
	// CodeReplayFailed (500): the BodyReferencer could not resolve a stored
	// reference.
	CodeReplayFailed = "replay_failed"
	// CodeHandlerFailed (500): storing the response or the body reference failed.
	CodeHandlerFailed = "response_not_saved"
	// CodeCommitUnknown (503, Retry-After): COMMIT failed, so whether the request
	// took effect is unknown; a retry with the same key settles it.
	CodeCommitUnknown = "commit_unknown"
	// CodeDatabaseUnavailable (503, Retry-After): Postgres could not be reached or
	// the idem tables are missing; nothing ran.
	CodeDatabaseUnavailable = "database_unavailable"
	// CodeTimeout (503, Retry-After): the request's context ended (a deadline)
	// before the commit; its work was rolled back.
	CodeTimeout = "request_timeout"
	// CodeRecoveryFailed (503, Retry-After): Config.Lease.Recover failed on a stale key.
	CodeRecoveryFailed = "recovery_failed"
	// CodeShardRoute (500): with Config.Shards, the route gave no shard for the
	// request's tenant (shard.ErrRoute); nothing ran.
	CodeShardRoute = "shard_route"
)

// errNoOperation is returned by defaultOperation when the request has no route
// pattern to name its operation by.
var errNoOperation = errcode.Permanent(CodeNoOperation, "no operation: the request has no http.ServeMux pattern (wrap each route's handler, not the mux) and Config.Operation is not set")

// Problem is an RFC 9457 problem details object, as idem writes it.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// Code is the stable code (the Code* constants).
	Code string `json:"code"`
}

var problemStatus = map[string]int{
	CodeKeyMissing: 400, CodeKeyInvalid: 400, CodeTenantInvalid: 400, CodeBodyNotJSON: 400,
	CodeFingerprintFailed: 400, CodeBodyUnreadable: 400, CodeRequestTooLarge: 413,
	CodeFingerprintMismatch: 422, CodeInProgress: 409, CodeResponseTooLarge: 500,
	CodeTransactionEnded: 500, CodeHandlerCommitted: 500, CodeHandlerEndedTransaction: 500, CodeNoOperation: 500, CodeResponseNotStored: 500, CodeReplayFailed: 500,
	CodeHandlerFailed: 500, CodeCommitUnknown: 503, CodeDatabaseUnavailable: 503, CodeTimeout: 503,
	CodeRecoveryFailed: 503, CodeShardRoute: 500,
}

var problemTitle = map[string]string{
	CodeKeyMissing:              "Idempotency-Key header required",
	CodeKeyInvalid:              "Idempotency-Key header invalid",
	CodeTenantInvalid:           "Tenant invalid",
	CodeBodyNotJSON:             "Request body is not valid JSON",
	CodeFingerprintFailed:       "Request cannot be fingerprinted",
	CodeBodyUnreadable:          "Request body unreadable",
	CodeRequestTooLarge:         "Request body too large",
	CodeFingerprintMismatch:     "Idempotency key reused with a different request",
	CodeInProgress:              "A request with this idempotency key is in progress",
	CodeResponseTooLarge:        "Response too large to store",
	CodeTransactionEnded:        "Request's transaction cannot commit",
	CodeHandlerCommitted:        "Handler committed the request's transaction itself",
	CodeHandlerEndedTransaction: "Handler ended the request's transaction itself",
	CodeNoOperation:             "Operation unknown",
	CodeResponseNotStored:       "No stored response for this idempotency key",
	CodeReplayFailed:            "Stored response cannot be replayed",
	CodeHandlerFailed:           "Response not saved",
	CodeCommitUnknown:           "Outcome unknown",
	CodeDatabaseUnavailable:     "Service unavailable",
	CodeTimeout:                 "Request timed out",
	CodeRecoveryFailed:          "Recovery of an interrupted request failed",
	CodeShardRoute:              "No shard for the tenant",
}

// retryAfterCodes get a Retry-After header.
var retryAfterCodes = map[string]bool{CodeInProgress: true, CodeCommitUnknown: true, CodeDatabaseUnavailable: true, CodeTimeout: true, CodeRecoveryFailed: true}

// The details of the stored handler_committed and handler_ended_transaction
// answers.
const (
	handlerCommittedDetail = "the handler committed the request's transaction itself, so the key and part of the request's work committed without an answer; this answer is stored for the key, every retry with the key gets it again, and the request will not run again"
	handlerEndedDetail     = "the handler ended the request's transaction itself, so what it wrote after that committed on its own, without an answer; this answer is stored for the key, every retry with the key gets it again, and the request will not run again"
)

// problemResponse is the problem for code as a response.
func problemResponse(code, detail string, retryAfter time.Duration) *Response {
	p := Problem{Type: ProblemTypePrefix + code, Title: problemTitle[code], Status: problemStatus[code], Detail: detail, Code: code}
	body, _ := json.Marshal(p)
	h := http.Header{"Content-Type": {"application/problem+json"}}
	if retryAfterCodes[code] {
		h.Set("Retry-After", strconv.Itoa(int(math.Ceil(max(retryAfter, time.Second).Seconds()))))
	}
	return &Response{Status: p.Status, Header: h, Body: body}
}
