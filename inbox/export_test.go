package inbox

// BatchSQL exposes the set-based claim's statements to the plan test.
func BatchSQL(schema string) (claim, get string) {
	q := newQueries(quoteIdent(schema))
	return q.claimBatch, q.getBatch
}
