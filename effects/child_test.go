package effects_test

const childRoleEnv = "IDEM_EFFECTS_TEST_CHILD"

func runChild(role string) int { return 2 }
