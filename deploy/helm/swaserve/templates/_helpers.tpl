{{/* Names, labels and the pieces every swaserve container shares. */}}

{{- define "swaserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "swaserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "swaserve.labels" -}}
{{ include "swaserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The label selector routers discover workers with (--selector). */}}
{{- define "swaserve.discoverySelector" -}}
app.kubernetes.io/name={{ .Chart.Name }},app.kubernetes.io/instance={{ .Release.Name }}
{{- end -}}

{{- define "swaserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "swaserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "swaserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag) -}}
{{- end -}}

{{- define "swaserve.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "swaserve.fullname" .)) .Values.auth.apiKey.existingSecret -}}
{{- end -}}

{{- define "swaserve.adminTokenSecret" -}}
{{- default (printf "%s-admin-token" (include "swaserve.fullname" .)) .Values.auth.adminToken.existingSecret -}}
{{- end -}}

{{- define "swaserve.redisHost" -}}
{{- printf "%s-redis" (include "swaserve.fullname" .) -}}
{{- end -}}

{{/* The Redis key namespace of this release's routers and prefill workers (one Redis may serve
several releases). */}}
{{- define "swaserve.redisNamespace" -}}
{{- printf "swaserve.%s.%s" .Release.Namespace .Release.Name -}}
{{- end -}}

{{- define "swaserve.redisSecret" -}}
{{- default (printf "%s-redis" (include "swaserve.fullname" .)) .Values.redis.bundled.auth.existingSecret -}}
{{- end -}}

{{/* Environment of a container that talks to Redis: REDIS_URL (its password from a Secret). */}}
{{- define "swaserve.redisEnv" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- $r := .Values.redis.bundled }}
{{- if $r.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "swaserve.redisSecret" . }}
      key: {{ $r.auth.secretKey }}
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%d/0" (include "swaserve.redisHost" .) (int $r.port) | quote }}
{{- else }}
- name: REDIS_URL
  value: {{ printf "redis://%s:%d/0" (include "swaserve.redisHost" .) (int $r.port) | quote }}
{{- end }}
{{- else if eq .Values.redis.mode "external" }}
{{- if .Values.redis.external.existingSecret }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.secretKey }}
{{- else }}
- name: REDIS_URL
  value: {{ required "redis.external.url or redis.external.existingSecret is required with redis.mode external" .Values.redis.external.url | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A container's env: the chart's entries (YAML text), then the user's; a user entry replaces the
chart's of the same name (duplicate names break server-side apply). Args: dict chart, user. */}}
{{- define "swaserve.env" -}}
{{- $user := default list .user -}}
{{- $names := dict -}}
{{- range $user }}{{ $_ := set $names .name true }}{{ end -}}
{{- $out := list -}}
{{- range (default "[]" .chart | fromYamlArray) }}
{{- if not (hasKey $names .name) }}{{ $out = append $out . }}{{ end }}
{{- end -}}
{{- $all := concat $out $user -}}
{{- if $all }}{{ toYaml $all }}{{ else }}[]{{ end -}}
{{- end -}}

{{/* Prompt tokens of a bucket bound ("16k" = 16384). */}}
{{- define "swaserve.tokens" -}}
{{- $s := lower (trim .) -}}
{{- if hasSuffix "k" $s -}}{{ mul (trimSuffix "k" $s | int64) 1024 }}{{- else -}}{{ $s | int64 }}{{- end -}}
{{- end -}}

{{/* The model flag and volume pieces. */}}
{{- define "swaserve.modelArgs" -}}
- --model
- {{ .Values.model.path | quote }}
{{- end -}}

{{- define "swaserve.modelVolumeMounts" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ ne .Values.model.source "init" }}
{{- end }}
{{- end -}}

{{- define "swaserve.modelVolumes" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- else if eq .Values.model.source "init" }}
- name: model
  emptyDir:
    sizeLimit: {{ .Values.model.init.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "swaserve.modelInitContainers" -}}
{{- if eq .Values.model.source "init" }}
- name: fetch-model
  image: {{ required "model.init.image is required with model.source init" .Values.model.init.image }}
  command: {{ required "model.init.command is required with model.source init" .Values.model.init.command | toJson }}
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
  securityContext: {{ toJson .Values.securityContext }}
{{- end }}
{{- end -}}

{{/* Pod-level fields every swaserve pod shares. Args: dict root, spec (role values), component. */}}
{{- define "swaserve.podCommon" -}}
{{- $root := .root -}}
serviceAccountName: {{ include "swaserve.serviceAccountName" $root }}
# only routers discovering workers talk to the Kubernetes API
automountServiceAccountToken: {{ and (eq .component "router") (eq $root.Values.router.discovery.mode "kubernetes") }}
{{- with $root.Values.image.pullSecrets }}
imagePullSecrets: {{ toJson . }}
{{- end }}
securityContext: {{ toJson $root.Values.podSecurityContext }}
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector: {{ toJson . }}
{{- end }}
{{- with .spec.tolerations }}
tolerations: {{ toJson . }}
{{- end }}
{{- with .spec.affinity }}
affinity: {{ toJson . }}
{{- end }}
{{- if $root.Values.topologySpread.enabled }}
topologySpreadConstraints:
  - maxSkew: {{ $root.Values.topologySpread.maxSkew }}
    topologyKey: {{ $root.Values.topologySpread.topologyKey }}
    whenUnsatisfiable: {{ $root.Values.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "swaserve.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
        {{- with .bucket }}
        swaserve.io/bucket: {{ . }}
        {{- end }}
{{- end }}
{{- end -}}

{{/* TLS flags and mounts for gRPC clients and servers. */}}
{{- define "swaserve.grpcTlsVolume" -}}
{{- if .Values.tls.grpc.enabled }}
- name: grpc-tls
  secret:
    secretName: {{ required "tls.grpc.secretName is required with tls.grpc.enabled" .Values.tls.grpc.secretName }}
{{- end }}
{{- end -}}

{{- define "swaserve.grpcTlsMount" -}}
{{- if .Values.tls.grpc.enabled }}
- name: grpc-tls
  mountPath: /etc/swaserve/grpc-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "swaserve.grpcClientTlsArgs" -}}
{{- if .Values.tls.grpc.enabled }}
- --grpc-tls-ca
- /etc/swaserve/grpc-tls/ca.crt
- --grpc-tls-server-name
- {{ .Values.tls.grpc.serverName }}
{{- end }}
{{- end -}}

{{- define "swaserve.grpcServerTlsArgs" -}}
{{- if .Values.tls.grpc.enabled }}
- --grpc-tls-cert
- /etc/swaserve/grpc-tls/tls.crt
- --grpc-tls-key
- /etc/swaserve/grpc-tls/tls.key
- --health-port
- {{ .Values.tls.grpc.healthPort | quote }}
{{- end }}
{{- end -}}

{{/* The port kubelet probes workers' gRPC health on. */}}
{{- define "swaserve.workerProbePort" -}}
{{- if .Values.tls.grpc.enabled -}}
{{- .Values.tls.grpc.healthPort -}}
{{- else -}}
{{- .Values.workerPorts.grpc -}}
{{- end -}}
{{- end -}}

{{/* GCache: the StatefulSet's (and its headless Service's) name. */}}
{{- define "swaserve.gcacheName" -}}
{{- printf "%s-gcache" (include "swaserve.fullname" .) -}}
{{- end -}}

{{/* GCache's guards: it needs a Redis (the node registry prefill workers discover nodes in). */}}
{{- define "swaserve.gcacheChecks" -}}
{{- if .Values.gcache.enabled }}
{{- if eq .Values.redis.mode "none" }}
{{- fail "gcache.enabled needs a Redis (nodes register there, prefill workers find them there): redis.mode bundled or external" }}
{{- end }}
{{- $v := .Values.gcache.nvme.volume }}
{{- if and .Values.gcache.nvme.enabled (eq $v.type "hostPath") (not $v.hostPath.path) }}
{{- fail "gcache.nvme.volume.hostPath.path is required with gcache.nvme.volume.type hostPath" }}
{{- end }}
{{- if and .Values.gcache.nvme.enabled (eq $v.type "hostPath") (eq .Values.gcache.antiAffinity "soft") (not .Values.gcache.affinity) }}
{{- fail "gcache.nvme.volume.type hostPath: set gcache.antiAffinity hard (two nodes on one host would share hostPath.path and the second could not lock its tier), or none with an affinity of your own" }}
{{- end }}
{{- $g := .Values.gcache }}
{{- with dig "limits" "memory" "" $g.resources }}
{{- if ge (include "swaserve.bytes" $g.dram | int64) (include "swaserve.quantityBytes" . | int64) }}
{{- fail (printf "gcache.dram %s does not fit gcache.resources.limits.memory %s (the node holds its DRAM tier plus about 1 GiB)" $g.dram .) }}
{{- end }}
{{- end }}
{{- if $g.nvme.enabled }}
{{- $room := "" }}
{{- if eq $v.type "pvc" }}{{ $room = $v.size }}{{ else if eq $v.type "emptyDir" }}{{ $room = $v.emptyDir.sizeLimit }}{{ end }}
{{- if and $room (gt (include "swaserve.bytes" $g.nvme.capacity | int64) (include "swaserve.quantityBytes" $room | int64)) }}
{{- fail (printf "gcache.nvme.capacity %s is more than its %s volume's %s (the tier preallocates its slot files)" $g.nvme.capacity $v.type $room) }}
{{- end }}
{{- end }}
{{- if and (not .Values.gcache.ucx.enabled) (eq .Values.gcache.prefill.transport "ucx") }}
{{- fail "gcache.prefill.transport ucx needs gcache.ucx.enabled (the nodes would have no UCX port and every L3 call would fail): use auto or grpc" }}
{{- end }}
{{- $r := splitList "-" .Values.gcache.ucx.tcpPortRange }}
{{- if or (gt (int (index $r 0)) (int (index $r 1))) (gt (int (index $r 1)) 65535) (lt (int (index $r 0)) 1) }}
{{- fail (printf "gcache.ucx.tcpPortRange %s: needs 1 <= LO <= HI <= 65535" .Values.gcache.ucx.tcpPortRange) }}
{{- end }}
{{- $p := $g.ports }}
{{- $ports := list (int $p.grpc) (int $p.metrics) }}
{{- if $g.ucx.enabled }}{{ $ports = append $ports (int $p.ucx) }}{{ end }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail (printf "gcache.ports %v: the node listens on each, so they must differ" $ports) }}
{{- end }}
{{- if and $g.ucx.enabled (le (int (index $r 0)) (int $p.ucx)) (le (int $p.ucx) (int (index $r 1))) }}
{{- fail (printf "gcache.ports.ucx %d is inside gcache.ucx.tcpPortRange %s (UCX's own TCP connections take those ports)" (int $p.ucx) $g.ucx.tcpPortRange) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A prefill worker's L3 flags while gcache is enabled (--l3-url: the live nodes registered in
    Redis under this release's namespace, read from SWASERVE_L3_URL, so a Redis password stays
    out of argv). */}}
{{- define "swaserve.gcachePrefillArgs" -}}
{{- if .Values.gcache.enabled }}
{{- $c := .Values.gcache.prefill }}
- --host-cache-memory
- {{ $c.hostCacheMemory | quote }}
- --l3-min-tokens
- {{ $c.minTokens | quote }}
- --l3-timeout-s
- {{ $c.timeoutSeconds | quote }}
- --l3-timeout-per-ki-token-s
- {{ $c.timeoutPerKiTokenSeconds | quote }}
{{- with $c.weightsId }}
- --weights-id
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Env entries of a prefill worker while gcache is enabled (after swaserve.redisEnv's). REDIS_URL
comes from a Secret and may have a query of its own: the client reads a second "?" as "&". */}}
{{- define "swaserve.gcachePrefillEnv" -}}
{{- if .Values.gcache.enabled }}
- name: SWASERVE_L3_URL
  value: {{ printf "$(REDIS_URL)?namespace=%s&transport=%s" (include "swaserve.redisNamespace" .) .Values.gcache.prefill.transport | quote }}
{{- if .Values.gcache.ucx.enabled }}
- name: UCX_TCP_PORT_RANGE
  value: {{ .Values.gcache.ucx.tcpPortRange | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Encoders: the StatefulSet's (and its headless Service's) name. */}}
{{- define "swaserve.encoderName" -}}
{{- printf "%s-encoder" (include "swaserve.fullname" .) -}}
{{- end -}}

{{/* The encoders' gRPC addresses, one per pod name (a YAML list): what routers get as --encoder.
    Every ordinal up to autoscaling.maxReplicas when an autoscaler owns the replica count (a name
    with no pod is down at the routers' polls and gets nothing), else up to replicas. */}}
{{- define "swaserve.encoderAddresses" -}}
{{- $e := .Values.encoder -}}
{{- $name := include "swaserve.encoderName" . -}}
{{- $n := ternary $e.autoscaling.maxReplicas $e.replicas $e.autoscaling.enabled | int -}}
{{- range $i := until $n }}
- {{ printf "%s-%d.%s.%s.svc.%s:%d" $name $i $name $.Release.Namespace $.Values.clusterDomain (int $e.ports.grpc) }}
{{- end }}
{{- end -}}

{{/* A byte size as swaserve's flags read it (1GiB, 1.5G, 512MiB: powers of 1024; 1GB: of 1000)
    -> bytes (an integer). */}}
{{- define "swaserve.bytes" -}}
{{- $s := lower (toString .) -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $s -}}
{{- $unit := trimPrefix $num $s -}}
{{- $units := dict "" 1 "b" 1 "k" 1024 "ki" 1024 "kib" 1024 "kb" 1000 "m" 1048576 "mi" 1048576 "mib" 1048576 "mb" 1000000 "g" 1073741824 "gi" 1073741824 "gib" 1073741824 "gb" 1000000000 "t" 1099511627776 "ti" 1099511627776 "tib" 1099511627776 "tb" 1000000000000 -}}
{{- if not (hasKey $units $unit) }}{{ fail (printf "%q is not a byte size (e.g. 512MiB, 1GiB)" .) }}{{ end -}}
{{- mulf (float64 $num) (get $units $unit) | int64 -}}
{{- end -}}

{{/* A Kubernetes quantity of bytes (1Gi, 512Mi: powers of 1024; 1G, 500M, 1k: of 1000) -> bytes. */}}
{{- define "swaserve.quantityBytes" -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- . | int64 -}}
{{- else -}}
{{- $s := toString . -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $s -}}
{{- $unit := trimPrefix $num $s -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if not (hasKey $units $unit) }}{{ fail (printf "%q is not a Kubernetes quantity of bytes (e.g. 1Gi)" .) }}{{ end -}}
{{- mulf (float64 $num) (get $units $unit) | int64 -}}
{{- end -}}
{{- end -}}

{{/* Encoders' guards. */}}
{{- define "swaserve.encoderChecks" -}}
{{- $e := .Values.encoder }}
{{- if $e.enabled }}
{{- if and (hasPrefix "cuda" $e.device) (lt (int $e.gpus) 1) }}
{{- fail (printf "encoder.device %s needs encoder.gpus >= 1 (the encoder exits without a CUDA device)" $e.device) }}
{{- end }}
{{- if and $e.autoscaling.enabled (gt (int $e.autoscaling.minReplicas) (int $e.autoscaling.maxReplicas)) }}
{{- fail (printf "encoder autoscaling: minReplicas %d > maxReplicas %d" (int $e.autoscaling.minReplicas) (int $e.autoscaling.maxReplicas)) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A prefill worker's media flags while encoders are enabled. */}}
{{- define "swaserve.encoderPrefillArgs" -}}
{{- if .Values.encoder.enabled }}
- --media-staging-memory
- {{ .Values.encoder.prefill.stagingMemory | quote }}
- --media-fetch-timeout
- {{ .Values.encoder.prefill.fetchTimeout | quote }}
{{- end }}
{{- end -}}

{{/* Expert parallelism of one prefill bucket (its merged values, `spec.ep`): the guards that
    catch at install what the worker would refuse at start (or run wrong). Args: dict name (the
    bucket's Deployment), spec. */}}
{{- define "swaserve.epChecks" -}}
{{- $ep := .spec.ep -}}
{{- $size := int $ep.size -}}
{{- $where := printf "prefill bucket %s" .name -}}
{{- range $a := .spec.engineArgs }}
{{- if or (hasPrefix "--ep-size" $a) (hasPrefix "--ep-placement" $a) }}
{{- fail (printf "%s: engineArgs has %s: set prefill.defaults.ep (or the bucket's ep) instead, which also sizes the pod's GPUs and /dev/shm" $where $a) }}
{{- end }}
{{- end }}
{{- if gt $size 1 }}
{{- if gt (int .spec.gpus) 1 }}
{{- fail (printf "%s: ep.size %d runs one rank per GPU (rank r on GPU r mod the count): gpus is per rank, set it to 1 (the pod then requests %d GPUs) or 0 (CPU)" $where $size $size) }}
{{- end }}
{{- $args := .spec.engineArgs | default list }}
{{- range $i, $a := $args }}
{{- if or (eq $a "--engine-process=inline") (and (eq $a "--engine-process") (lt (add1 $i) (len $args)) (eq (index $args (add1 $i)) "inline")) }}
{{- fail (printf "%s: ep.size %d runs each rank in its own process: drop --engine-process inline from engineArgs" $where $size) }}
{{- end }}
{{- end }}
{{- end }}
{{- with (default dict $ep.placement).ranks }}
{{- if eq $size 1 }}
{{- fail (printf "%s: ep.placement places experts on %d ranks but ep.size is 1 (no expert parallelism): set ep.size %d" $where (len .) (len .)) }}
{{- end }}
{{- if ne (len .) $size }}
{{- fail (printf "%s: ep.placement has %d ranks, ep.size is %d" $where (len .) $size) }}
{{- end }}
{{- $flat := list }}
{{- range $r := . }}{{ range $e := $r }}{{ $flat = append $flat (int $e) }}{{ end }}{{ end }}
{{- $n := len $flat }}
{{- range $e := $flat }}
{{- if ge $e $n }}
{{- fail (printf "%s: ep.placement must list experts 0..%d exactly once each (it lists %d experts, expert %d is out of range)" $where (sub $n 1) $n $e) }}
{{- end }}
{{- end }}
{{- if ne (len (uniq $flat)) $n }}
{{- fail (printf "%s: ep.placement must list experts 0..%d exactly once each (some are repeated)" $where (sub $n 1)) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The --ep-placement file of a bucket (JSON), "" without one. Args: spec. */}}
{{- define "swaserve.epPlacementJson" -}}
{{- with (default dict .spec.ep.placement).ranks -}}
{{- $ranks := list -}}
{{- range $r := . }}{{ $experts := list }}{{ range $e := $r }}{{ $experts = append $experts (int $e) }}{{ end }}{{ $ranks = append $ranks $experts }}{{ end -}}
{{- dict "ranks" $ranks | toJson -}}
{{- end -}}
{{- end -}}

{{/* A component's podLabels (dict: labels, owner), refused where they would replace the chart's
    own: the Deployments' selectors, the discovery and the NetworkPolicies match on those. */}}
{{- define "swaserve.podLabels" -}}
{{- range $k, $_ := .labels }}
{{- if or (has $k (list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component")) (hasPrefix "swaserve.io/" $k) }}
{{- fail (printf "%s: podLabels has %s, one of the chart's own labels (selectors and worker discovery match on them): choose another key" $.owner $k) }}
{{- end }}
{{- end }}
{{- with .labels }}{{ toYaml . }}{{ end }}
{{- end -}}
