// Package errcode is idem's one coded error type. Every idem package's sentinel
// errors are *Error values: a message, a stable code that logs, metrics and RFC 9457
// problem details carry, and whether the failure is permanent (the same input can
// never succeed, so retrying it is pointless). The public packages re-export the type
// under their own name (inbox.Error, inbox.Error, consumer.Error, …), so callers
// compare with errors.Is against the sentinels and read the code with errors.As or
// Code.
//
// It imports nothing of idem, so every package can use it.
package errcode

import (
	"errors"
	"fmt"
)

// Error is an error with a stable code. Compare with errors.Is against a package's
// sentinels; the code and the permanence are for logs, metrics and retry decisions.
type Error struct {
	code      string
	msg       string
	permanent bool
}

// Permanent returns a sentinel for a failure that retrying cannot fix.
func Permanent(code, msg string) *Error { return &Error{code: code, msg: msg, permanent: true} }

// Transient returns a sentinel for a failure that may pass: the same input may
// succeed later.
func Transient(code, msg string) *Error { return &Error{code: code, msg: msg} }

// Error is "idem: " and the message.
func (e *Error) Error() string { return "idem: " + e.msg }

// Code is the stable machine-readable code, such as "empty_key".
func (e *Error) Code() string { return e.code }

// Permanent reports whether the same input can never succeed, so that retrying it is
// pointless. The consumer records or poisons permanent errors instead of nacking.
func (e *Error) Permanent() bool { return e.permanent }

// Code returns the stable code of the first error in err's chain that has one (a
// Code() string method), or "" when none does.
func Code(err error) string {
	var c interface{ Code() string }
	if errors.As(err, &c) {
		return c.Code()
	}
	return ""
}

// IsPermanent reports whether an error in err's chain says it is permanent (a
// Permanent() bool method that returns true).
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}

// ErrInvalidConfig is the sentinel every config error wraps: a constructor's
// "invalid config: …" error finds it with errors.Is, and its code is
// "invalid_config". It is permanent: the same config fails the same way.
var ErrInvalidConfig = Permanent("invalid_config", "invalid config")

// InvalidConfig returns an error that says what is wrong with a config (the
// format and args, such as "Pool is required") and wraps ErrInvalidConfig. Its
// text is the description alone, since the constructor that returns it adds
// "invalid config: ".
func InvalidConfig(format string, args ...any) error {
	return &configError{msg: fmt.Sprintf(format, args...)}
}

type configError struct{ msg string }

func (e *configError) Error() string { return e.msg }
func (e *configError) Unwrap() error { return ErrInvalidConfig }
