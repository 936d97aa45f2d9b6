// Package redact hides database passwords in what idem's tools and tests print:
// a DSN shown to a person, and any error or log text that may quote one.
//
// It guarantees that the password of the DSN it is given (from the URL's userinfo,
// a password or sslpassword query parameter, a key=value password, or what pgx
// reads for it from PGPASSWORD or the passfile) does not appear in its output, in
// raw, URL-escaped or quoted form. It knows no other secrets: text that quotes a
// password of some other DSN is not changed.
package redact
