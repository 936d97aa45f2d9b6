package admin

// SetMoveStep sets the function MoveTenant calls after each committed step, for
// the crash tests' children.
func SetMoveStep(f func(step string)) { moveStep = f }

// ListGroupsSQL is the statement of ListGroups in schema, for the plan tests.
func ListGroupsSQL(schema string) string { return newQueries(schema).listGroups }

// GroupSamplesSQL is the statement that reads the samples of a merged page's
// groups on one shard, in schema, for the plan tests.
func GroupSamplesSQL(schema string) string { return newQueries(schema).groupSamples }
