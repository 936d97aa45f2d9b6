package effects

// SanitizeText exposes the package's copy of inbox.SanitizeText to the tests, which
// check that the two stay identical.
var SanitizeText = sanitizeText
