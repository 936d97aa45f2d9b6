package kafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/internal/errcode"
)

var (
	// ErrGroupRefused matches, through errors.Is, every GroupRefusedError.
	ErrGroupRefused = errors.New("kafka: the consumer group refused this member")

	// ErrInvalidConfig is wrapped by the error NewPublisher or NewSubscriber
	// returns for a config it refuses (code "invalid_config"). Every idem package
	// has the same value.
	ErrInvalidConfig = errcode.ErrInvalidConfig

	// ErrPublisherClosed is returned by Publish after Close.
	ErrPublisherClosed = errors.New("kafka: publisher closed")

	// ErrSubscriberClosed is returned by Subscribe after Close.
	ErrSubscriberClosed = errors.New("kafka: subscriber closed")
)

// GroupRefusedError is a consumer group's refusal that retrying cannot fix:
// a session timeout outside the broker's bounds, a missing ACL, members that
// disagree on the assignment protocol, a full group. Subscribe returns it
// when it comes on the first join; later, it ends the subscription (the
// channel closes) after an error log that carries it. Fix the configuration
// and subscribe again.
//
// errors.Is matches it against ErrGroupRefused and against the broker's code
// (for example kafka.InvalidSessionTimeout).
type GroupRefusedError struct {
	GroupID string
	// Err is the broker's error code.
	Err kafka.Error
	// Hint says what to do.
	Hint string
}

func (e *GroupRefusedError) Error() string {
	return fmt.Sprintf("kafka: consumer group %s refused this member: %s (error %d): %s",
		e.GroupID, e.Err.Title(), int(e.Err), e.Hint)
}

// Code returns CodeGroupRefused.
func (e *GroupRefusedError) Code() string { return CodeGroupRefused }

// Unwrap returns ErrGroupRefused and the broker's error code.
func (e *GroupRefusedError) Unwrap() []error { return []error{ErrGroupRefused, e.Err} }

// refusal returns a *GroupRefusedError when err, from joining the group, is
// one that retrying cannot fix, and nil when the group should retry.
func (s *Subscriber) refusal(ctx context.Context, transport kafka.RoundTripper, err error) error {
	var code kafka.Error
	if !errors.As(err, &code) {
		return nil
	}
	var hint string
	switch code {
	case kafka.InvalidSessionTimeout:
		hint = s.sessionTimeoutHint(ctx, transport)
	case kafka.InconsistentGroupProtocol:
		hint = "the group's other members use a different partition assignment protocol; give every member the same GroupBalancers, or use another GroupID"
	case kafka.InvalidGroupId:
		hint = fmt.Sprintf("the broker does not accept %q as a group ID", s.cfg.GroupID)
	case kafka.GroupAuthorizationFailed:
		hint = fmt.Sprintf("this principal may not use group %s: grant it the READ operation on the group", s.cfg.GroupID)
	case kafka.TopicAuthorizationFailed:
		hint = "this principal may not read the topic: grant it DESCRIBE and READ on the topic"
	case kafka.ClusterAuthorizationFailed:
		hint = "this principal lacks a cluster permission the request needs"
	case kafka.GroupMaxSizeReached:
		hint = "the group already has the broker's group.max.size members: run fewer members, or raise group.max.size"
	case kafka.FencedInstanceID:
		hint = "another member uses the same group instance ID"
	case kafka.UnsupportedVersion:
		hint = "the broker does not support a request version the group needs"
	case kafka.SASLAuthenticationFailed, kafka.UnsupportedSASLMechanism, kafka.IllegalSASLState:
		hint = "check the Dialer's SASL mechanism and credentials"
	default:
		return nil
	}
	return &GroupRefusedError{GroupID: s.cfg.GroupID, Err: code, Hint: hint}
}

const (
	configMinSession = "group.min.session.timeout.ms"
	configMaxSession = "group.max.session.timeout.ms"
)

// sessionTimeoutHint asks the group's coordinator for its session timeout
// bounds, so the hint can say which bound SessionTimeout broke and what to
// set. A JoinGroup refusal carries no bounds, and a principal may not be
// allowed to describe broker configs, so it falls back to Kafka's defaults.
func (s *Subscriber) sessionTimeoutHint(ctx context.Context, transport kafka.RoundTripper) string {
	have := s.cfg.SessionTimeout
	lo, hi, err := s.sessionBounds(ctx, transport)
	if err != nil {
		return fmt.Sprintf("SessionTimeout %s is outside the broker's %s..%s (Kafka's defaults: 6s..30m; "+
			"the broker's own values could not be read: %v); set SessionTimeout within them",
			have, configMinSession, configMaxSession, err)
	}
	if have < lo {
		return fmt.Sprintf("broker %s is %d (%s); SessionTimeout is %s: set SessionTimeout >= %s "+
			"(or lower %s on the broker)", configMinSession, lo.Milliseconds(), lo, have, lo, configMinSession)
	}
	if have > hi {
		return fmt.Sprintf("broker %s is %d (%s); SessionTimeout is %s: set SessionTimeout <= %s",
			configMaxSession, hi.Milliseconds(), hi, have, hi)
	}
	return fmt.Sprintf("SessionTimeout %s is within the broker's %s=%d and %s=%d as the coordinator reports them now; "+
		"the broker that refused it may differ", have, configMinSession, lo.Milliseconds(), configMaxSession, hi.Milliseconds())
}

func (s *Subscriber) sessionBounds(ctx context.Context, transport kafka.RoundTripper) (lo, hi time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c := &kafka.Client{Addr: kafka.TCP(s.cfg.Brokers...), Transport: transport}
	fc, err := c.FindCoordinator(ctx, &kafka.FindCoordinatorRequest{Key: s.cfg.GroupID, KeyType: kafka.CoordinatorKeyTypeConsumer})
	if err == nil {
		err = fc.Error
	}
	if err != nil {
		return 0, 0, fmt.Errorf("find the group coordinator: %w", err)
	}
	res, err := c.DescribeConfigs(ctx, &kafka.DescribeConfigsRequest{
		Resources: []kafka.DescribeConfigRequestResource{{
			ResourceType: kafka.ResourceTypeBroker,
			ResourceName: strconv.Itoa(fc.Coordinator.NodeID),
			ConfigNames:  []string{configMinSession, configMaxSession},
		}},
	})
	if err != nil {
		return 0, 0, fmt.Errorf("describe broker %d: %w", fc.Coordinator.NodeID, err)
	}
	var found int
	for _, r := range res.Resources {
		if r.Error != nil {
			return 0, 0, fmt.Errorf("describe broker %d: %w", fc.Coordinator.NodeID, r.Error)
		}
		for _, e := range r.ConfigEntries {
			ms, err := strconv.ParseInt(e.ConfigValue, 10, 64)
			if err != nil {
				continue
			}
			switch e.ConfigName {
			case configMinSession:
				lo, found = time.Duration(ms)*time.Millisecond, found+1
			case configMaxSession:
				hi, found = time.Duration(ms)*time.Millisecond, found+1
			}
		}
	}
	if found != 2 {
		return 0, 0, fmt.Errorf("broker %d did not report %s and %s", fc.Coordinator.NodeID, configMinSession, configMaxSession)
	}
	return lo, hi, nil
}
