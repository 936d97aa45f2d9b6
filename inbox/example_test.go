package inbox_test

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/idemkit/idem/inbox"
)

// Two deliveries of one order whose JSON differs only in member order, spacing,
// number spelling and a field the fingerprint leaves out have one fingerprint, so
// the inbox sees the second as a duplicate of the first; a changed amount is a
// different payload (a mismatch, never a duplicate).
func ExampleCanonicalJSON() {
	fp := inbox.CanonicalJSON(inbox.JSONOptions{Exclude: []string{"sent_at"}})
	first, err := fp([]byte(`{"order": {"id": "o-1", "amount": 1.50}, "sent_at": "10:00"}`))
	if err != nil {
		panic(err)
	}
	retry, _ := fp([]byte(`{"sent_at":"10:05","order":{"amount":15e-1,"id":"o-1"}}`))
	changed, _ := fp([]byte(`{"order": {"id": "o-1", "amount": 1.51}, "sent_at": "10:00"}`))
	fmt.Println(bytes.Equal(first, retry), bytes.Equal(first, changed))
	// Output:
	// true false
}

// A key the inbox refuses is a permanent, coded error: a consumer poisons the
// message, httpidem answers 400 with the code.
func ExampleValidateKey() {
	err := inbox.ValidateKey("")
	fmt.Println(errors.Is(err, inbox.ErrEmptyKey), inbox.IsPermanent(err), inbox.Code(err))
	fmt.Println(inbox.ValidateKey("order-1") == nil)
	// Output:
	// true true empty_key
	// true
}
