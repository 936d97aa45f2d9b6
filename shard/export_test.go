package shard

// Score is the rendezvous weight, for the test that pins it.
var Score = score
