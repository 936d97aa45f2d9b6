package admin

// SetMoveStep sets the function MoveTenant calls after each committed step, for
// the crash tests' children.
func SetMoveStep(f func(step string)) { moveStep = f }
