-- Reverts 008: the statement trigger that wakes the dispatchers comes back, for
-- binaries that do not notify themselves.
CREATE FUNCTION /* schema */idem_effects_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('idem_effects', TG_TABLE_SCHEMA);
    RETURN NULL;
END;
$$;

CREATE TRIGGER effects_notify
    AFTER INSERT ON /* schema */effects
    FOR EACH STATEMENT EXECUTE FUNCTION /* schema */idem_effects_notify();
