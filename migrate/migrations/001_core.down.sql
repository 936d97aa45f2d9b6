DROP TRIGGER IF EXISTS effects_notify ON /* schema */effects;
DROP FUNCTION IF EXISTS /* schema */idem_effects_notify();
DROP TABLE IF EXISTS /* schema */effects;
DROP TABLE IF EXISTS /* schema */inbox;
