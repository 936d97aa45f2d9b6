package shard_test

import (
	"fmt"

	"github.com/idemkit/idem/shard"
)

// The route from tenant to shard: a rendezvous hash over the shard names, the
// same in every process, and a Table that pins a tenant (for example one moved
// to a shard of its own). The pools are left out here: routing reads the names
// alone.
func ExampleMap_Pick() {
	m := &shard.Map{
		Shards: []shard.Shard{{Name: "eu-1"}, {Name: "eu-2"}, {Name: "eu-3"}},
		Table:  map[string]string{"acme": "eu-3"},
	}
	for _, tenant := range []string{"acme", "globex", "initech", "umbrella"} {
		s, err := m.Pick(tenant)
		if err != nil {
			panic(err)
		}
		fmt.Println(tenant, "->", s.Name)
	}
	// The hash depends on the names, not their order.
	reordered := &shard.Map{Shards: []shard.Shard{{Name: "eu-3"}, {Name: "eu-1"}, {Name: "eu-2"}}}
	s, _ := reordered.Pick("globex")
	fmt.Println("globex ->", s.Name, "(reordered)")
	// Output:
	// acme -> eu-3
	// globex -> eu-3
	// initech -> eu-2
	// umbrella -> eu-2
	// globex -> eu-3 (reordered)
}
