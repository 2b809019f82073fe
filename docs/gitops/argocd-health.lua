-- Argo CD health check for rlenergy.io/RLEnergyPolicy (argocd-cm key:
-- resource.customizations.health.rlenergy.io_RLEnergyPolicy). Reads status.conditions, which
-- only the rl-energy operator writes:
--   Degraded=True                 -> Degraded  (node/GPU errors, invalid spec, reset deadline)
--   Ready=False                   -> Degraded  (the spec was refused)
--   RolloutStalled=True           -> Degraded  (a hung rollout engine: progress frozen)
--   Progressing=True/ResettingClocks -> Progressing (deletion waits for the clock resets)
--   Ready=True                    -> Healthy   (clock selection in progress is named in the
--                                                message: it restarts on every workload drift)
--   no status yet, or status.observedGeneration behind metadata.generation -> Progressing
local hs = {}
hs.status = "Progressing"
hs.message = "Waiting for the rl-energy operator to reconcile the policy"

local function describe(c)
  local text = c.type .. "=" .. c.status
  if c.reason ~= nil and c.reason ~= "" then
    text = text .. " (" .. c.reason .. ")"
  end
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

if obj.status == nil or obj.status.conditions == nil then
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed < generation then
  hs.message = "Waiting for the rl-energy operator to reconcile generation " .. generation
  return hs
end

local ready = nil
local progressing = nil
local degraded = nil
local stalled = nil
for _, c in ipairs(obj.status.conditions) do
  if c.type == "Ready" then
    ready = c
  elseif c.type == "Progressing" then
    progressing = c
  elseif c.type == "Degraded" then
    degraded = c
  elseif c.type == "RolloutStalled" then
    stalled = c
  end
end

if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end
if ready ~= nil and ready.status == "False" then
  hs.status = "Degraded"
  hs.message = describe(ready)
  return hs
end
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(stalled)
  return hs
end
if progressing ~= nil and progressing.status == "True" and progressing.reason == "ResettingClocks" then
  hs.status = "Progressing"
  hs.message = describe(progressing)
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  if progressing ~= nil and progressing.status == "True" then
    hs.message = hs.message .. "; " .. describe(progressing)
  end
  return hs
end
return hs
