-- wrk script of the benchmark: wrk -s bench/wrk.lua URL -- MODE PREFIX
--
-- Every request is the same POST with a small JSON body and an Idempotency-Key header:
--   new     a new key per request: PREFIX-<thread>-<counter> (PREFIX is unique per round)
--   replay  always the key PREFIX (the first request stores it, the rest are replays)
--   mix     like new, but 10 % of the requests reuse one of the thread's last 64 keys
-- At the end one line "BENCH_JSON {...}" carries the counts and latency percentiles (us).

local threads = {}

function setup(thread)
    thread:set("id", #threads + 1)
    table.insert(threads, thread)
end

local mode, prefix
local counter = 0
local recent = {}
local recent_size = 64

created, replayed, conflicts, others, duplicates_sent = 0, 0, 0, 0, 0

function init(args)
    mode = args[1] or "new"
    prefix = args[2] or "k"
    math.randomseed(os.time() * 1000 + id)
    wrk.method = "POST"
    wrk.body = '{"amount": 1000, "currency": "eur"}'
    wrk.headers["Content-Type"] = "application/json"
end

local function new_key()
    counter = counter + 1
    local key = prefix .. "-" .. id .. "-" .. counter
    recent[(counter - 1) % recent_size + 1] = key
    return key
end

function request()
    local key
    if mode == "replay" then
        key = prefix
    elseif mode == "mix" and counter > 0 and math.random() < 0.1 then
        key = recent[math.random(math.min(counter, recent_size))]
        duplicates_sent = duplicates_sent + 1
    else
        key = new_key()
    end
    wrk.headers["Idempotency-Key"] = key
    return wrk.format()
end

function response(status, headers, body)
    if status == 201 then
        if headers["Idempotent-Replayed"] then
            replayed = replayed + 1
        else
            created = created + 1
        end
    elseif status == 409 then
        conflicts = conflicts + 1
    else
        others = others + 1
    end
end

function done(summary, latency, requests)
    local totals = {created = 0, replayed = 0, conflicts = 0, others = 0, duplicates_sent = 0}
    for _, thread in ipairs(threads) do
        for name, _ in pairs(totals) do
            totals[name] = totals[name] + (thread:get(name) or 0)
        end
    end
    local e = summary.errors
    io.write(string.format(
        'BENCH_JSON {"requests": %d, "duration_us": %d, "bytes": %d, '
            .. '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, '
            .. '"p50_us": %d, "p90_us": %d, "p99_us": %d, "mean_us": %.1f, "max_us": %d, '
            .. '"created": %d, "replayed": %d, "conflicts": %d, "others": %d, '
            .. '"duplicates_sent": %d}\n',
        summary.requests, summary.duration, summary.bytes,
        e.connect, e.read, e.write, e.status, e.timeout,
        latency:percentile(50), latency:percentile(90), latency:percentile(99),
        latency.mean, latency.max,
        totals.created, totals.replayed, totals.conflicts, totals.others,
        totals.duplicates_sent))
end
