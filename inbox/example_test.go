package inbox_test

import (
	"errors"
	"fmt"

	"github.com/idemkit/idem/inbox"
)

// Two deliveries of one order whose JSON differs only in member order, spacing,
// number spelling and a field the fingerprint leaves out have one canonical form,
// so the inbox sees the second as a duplicate of the first; a changed amount is a
// different payload (a mismatch, never a duplicate).
func ExampleCanonicalize() {
	opts := inbox.JSONOptions{Exclude: []string{"sent_at"}}
	first := []byte(`{"order": {"id": "o-1", "amount": 1.50}, "sent_at": "10:00"}`)
	retry := []byte(`{"sent_at":"10:05","order":{"amount":15e-1,"id":"o-1"}}`)
	changed := []byte(`{"order": {"id": "o-1", "amount": 1.51}, "sent_at": "10:00"}`)
	for _, p := range [][]byte{first, retry, changed} {
		c, err := inbox.Canonicalize(p, opts)
		if err != nil {
			panic(err)
		}
		fmt.Println(string(c))
	}
	// Output:
	// {"order":{"amount":1.5,"id":"o-1"}}
	// {"order":{"amount":1.5,"id":"o-1"}}
	// {"order":{"amount":1.51,"id":"o-1"}}
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
