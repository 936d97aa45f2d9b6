package chaos

// SetBetweenReads makes a's reports call f after reading the inbox and before
// reading the business rows: a test commits there to race the report.
func SetBetweenReads(a *Auditor, f func()) { a.betweenReads = f }
