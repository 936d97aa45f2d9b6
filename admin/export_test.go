package admin

// SetMoveStep sets the function MoveTenant calls after each committed step, for
// the crash tests' children.
func SetMoveStep(f func(step string)) { moveStep = f }

// ListGroupsSQL is the statement of ListGroups in schema, for the plan tests.
func ListGroupsSQL(schema string) string { return newQueries(schema, true).listGroups }
