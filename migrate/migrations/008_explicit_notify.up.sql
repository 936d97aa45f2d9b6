-- idem 008: the effects' wake-up is sent by the statements that insert effects
-- (pg_notify in the insert), not by a statement trigger on the table, so every
-- statement idem issues stays a plain single-shard statement that a distributed
-- Postgres could route (a trigger on a sharded table runs on the workers, whose
-- notifications no dispatcher hears).
--
-- Rolling deploy: binaries that send the notification themselves work with or
-- without the trigger (while both exist, Postgres folds the two identical
-- notifications of a transaction into one). Deploy them first, then migrate. An
-- older binary still running after this migration enqueues effects without
-- waking the dispatchers: they are sent at the next poll (PollInterval), never lost.
DROP TRIGGER IF EXISTS effects_notify ON /* schema */effects;
DROP FUNCTION IF EXISTS /* schema */idem_effects_notify();
