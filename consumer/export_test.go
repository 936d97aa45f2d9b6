package consumer

// OutputUUID is outputUUID, for the tests that check an output message's ID.
var OutputUUID = outputUUID
