package kafka

// The metadata keys the Subscriber reads after a nack, for the tests that check
// them against the consumer middleware's.
const (
	MetadataErrorCode      = metadataErrorCode
	MetadataErrorPermanent = metadataErrorPermanent
)
