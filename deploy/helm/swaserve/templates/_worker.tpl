{{/*
One worker Deployment (prefill bucket, decode; later services add theirs the same way).
Args (dict):
  root       the chart's root context
  component  prefill | decode: the pod's role label and `python -m services.<component>`
  name       the Deployment's name
  bucket     prefill: the bucket's name ("" otherwise)
  replicas   replica count (left out when an autoscaler owns it)
  spec       the role's values, bucket overrides merged in (`ep`: expert parallelism, prefill)
  args       role-specific flags (a list)
An EP instance (spec.ep.size N > 1) is this one pod: N engine-core ranks as processes of the
worker, rendezvous on 127.0.0.1, gpus x N GPUs, /dev/shm grown by N x ep.shmPerRank, the
placement's ConfigMap (prefill.yaml) mounted as the --ep-placement file.
*/}}
{{- define "swaserve.workerDeployment" -}}
{{- $root := .root -}}
{{- $spec := .spec -}}
{{- $wp := $root.Values.workerPorts }}
{{- if eq (int $wp.grpc) (int $wp.metrics) }}
{{- fail (printf "workerPorts.grpc and workerPorts.metrics are both %d: a worker cannot listen twice on one port" (int $wp.grpc)) }}
{{- end }}
{{- if and $root.Values.tls.grpc.enabled (has (int $root.Values.tls.grpc.healthPort) (list (int $wp.grpc) (int $wp.metrics))) }}
{{- fail (printf "tls.grpc.healthPort %d is also a workerPorts port: the plaintext health port needs its own" (int $root.Values.tls.grpc.healthPort)) }}
{{- end }}
{{- range $a := $spec.engineArgs }}
{{- if hasPrefix "--speculative-num-steps" (toString $a) }}
{{- fail (printf "%s: engineArgs has %s: set model.speculativeNumSteps instead (prefill and decode must agree: prefill sends the first drafts with the KV)" $.name $a) }}
{{- end }}
{{- range $flag := list "--dtype" "--page-size" "--kv-layout" "--kv-cache-dtype" "--kv-quant-group" "--kv-kivi-" "--kv-sink-tokens" }}
{{- if hasPrefix $flag (toString $a) }}
{{- fail (printf "%s: engineArgs has %s: set it in model.kvArgs instead (every prefill and decode worker must store the same KV: prefill pages reach decode workers unconverted)" $.name $a) }}
{{- end }}
{{- end }}
{{- end }}
{{- $port := int $root.Values.workerPorts.grpc -}}
{{- $ep := default (dict "size" 1) $spec.ep -}}
{{- $epSize := int $ep.size -}}
{{- $placement := include "swaserve.epPlacementJson" (dict "spec" (dict "ep" $ep)) -}}
{{- $gpus := mul (int $spec.gpus) $epSize -}}
{{- $resources := deepCopy (default dict $spec.resources) -}}
{{- if gt $gpus 0 -}}
{{- $_ := set $resources "requests" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.requests)) -}}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $gpus) (default dict $resources.limits)) -}}
{{- end -}}
{{- $shm := $spec.shmSize -}}
{{- if gt $epSize 1 -}}
{{- $shm = add (include "swaserve.quantityBytes" $spec.shmSize | int64) (mul $epSize (include "swaserve.quantityBytes" $ep.shmPerRank | int64)) -}}
{{- end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "swaserve.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with .bucket }}
    swaserve.io/bucket: {{ . }}
    {{- end }}
spec:
  {{- if not $spec.autoscaling.enabled }}
  replicas: {{ .replicas }}
  {{- end }}
  revisionHistoryLimit: 3
  progressDeadlineSeconds: 3600
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "swaserve.selectorLabels" $root | nindent 6 }}
      app.kubernetes.io/component: {{ .component }}
      {{- with .bucket }}
      swaserve.io/bucket: {{ . }}
      {{- end }}
  template:
    metadata:
      labels:
        {{- include "swaserve.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .component }}
        swaserve.io/role: {{ .component }}
        {{- with .bucket }}
        swaserve.io/bucket: {{ . }}
        {{- end }}
        {{- include "swaserve.podLabels" (dict "labels" $spec.podLabels "owner" .name) | nindent 8 }}
      annotations:
        swaserve.io/grpc-port: {{ $port | quote }}
        {{- with $placement }}
        # the worker reads the placement at start: a new one rolls the pods
        swaserve.io/ep-placement-sha256: {{ sha256sum . }}
        {{- end }}
        {{- with $spec.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- include "swaserve.podCommon" (dict "root" $root "spec" $spec "component" .component "bucket" .bucket) | nindent 6 }}
      {{- with $root.Values.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      # preStop sleep + --shutdown-timeout + 15 s margin
      terminationGracePeriodSeconds: {{ add (int $spec.preStopSleep) (int $spec.shutdownTimeout) 15 }}
      {{- $init := include "swaserve.modelInitContainers" $root }}
      {{- if $init }}
      initContainers:
        {{- $init | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "swaserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["python", "-m", "services.{{ .component }}"]
          args:
            - --host
            - 0.0.0.0
            - --port
            - {{ $port | quote }}
            - --metrics-port
            - {{ $root.Values.workerPorts.metrics | quote }}
            {{- include "swaserve.modelArgs" $root | nindent 12 }}
            - --shutdown-timeout
            - {{ $spec.shutdownTimeout | quote }}
            # the address routers dial (the metrics' worker label, the prefix index's name)
            - --instance-id
            - {{ printf "$(POD_IP):%d" $port | quote }}
            {{- with $root.Values.model.servedModelName }}
            - --served-model-name
            - {{ . | quote }}
            {{- end }}
            {{- with $root.Values.model.speculativeNumSteps }}
            - --speculative-num-steps
            - {{ . | quote }}
            {{- end }}
            {{- with $root.Values.model.kvArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with include "swaserve.grpcServerTlsArgs" $root }}{{ . | nindent 12 }}{{- end }}
            {{- with include "swaserve.grpcClientTlsArgs" $root }}{{ . | nindent 12 }}{{- end }}
            {{- with .args }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- if gt $epSize 1 }}
            - --ep-size
            - {{ $epSize | quote }}
            - --ep-timeout-s
            - {{ $ep.timeoutSeconds | quote }}
            {{- if $placement }}
            - --ep-placement
            - /etc/swaserve/ep/placement.json
            {{- end }}
            {{- end }}
            {{- if eq .component "prefill" }}
            {{- with include "swaserve.gcachePrefillArgs" $root }}{{ . | nindent 12 }}{{- end }}
            {{- with include "swaserve.encoderPrefillArgs" $root }}{{ . | nindent 12 }}{{- end }}
            {{- end }}
            {{- with $spec.engineArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $env := list (dict "name" "POD_IP" "valueFrom" (dict "fieldRef" (dict "fieldPath" "status.podIP"))) | toYaml }}
          {{- $precise := and (eq .component "prefill") (eq $root.Values.router.indexMode "precise") }}
          {{- $l3 := and (eq .component "prefill") $root.Values.gcache.enabled }}
          {{- if or $precise $l3 }}
          {{- $env = printf "%s\n%s" $env (include "swaserve.redisEnv" $root) }}
          {{- end }}
          {{- if $precise }}
          {{- /* the URL (and its password) in the environment, not on the command line */}}
          {{- $env = printf "%s\n- name: SWASERVE_INDEX_REDIS_URL\n  value: $(REDIS_URL)" $env }}
          {{- end }}
          {{- if $l3 }}
          {{- $env = printf "%s\n%s" $env (include "swaserve.gcachePrefillEnv" $root) }}
          {{- end }}
          {{- if gt $epSize 1 }}
          {{- /* the ranks' gloo / NCCL sockets on the pod's loopback (one node, one pod) */}}
          {{- $env = printf "%s\n- name: GLOO_SOCKET_IFNAME\n  value: lo\n- name: NCCL_SOCKET_IFNAME\n  value: lo" $env }}
          {{- end }}
          env:
            {{- include "swaserve.env" (dict "chart" $env "user" $spec.env) | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $port }}
            - name: metrics
              containerPort: {{ $root.Values.workerPorts.metrics }}
            {{- if $root.Values.tls.grpc.enabled }}
            - name: health
              containerPort: {{ $root.Values.tls.grpc.healthPort }}
            {{- end }}
          startupProbe:
            grpc:
              port: {{ include "swaserve.workerProbePort" $root }}
            periodSeconds: {{ $spec.startupProbe.periodSeconds }}
            failureThreshold: {{ $spec.startupProbe.failureThreshold }}
          readinessProbe:
            grpc:
              port: {{ include "swaserve.workerProbePort" $root }}
            periodSeconds: {{ $spec.readinessProbe.periodSeconds }}
            failureThreshold: {{ $spec.readinessProbe.failureThreshold }}
          livenessProbe:
            # the process serves (a dead engine exits the worker); gRPC health turns NOT_SERVING
            # while draining, which must not restart it
            tcpSocket:
              port: grpc
            periodSeconds: {{ $spec.livenessProbe.periodSeconds }}
            failureThreshold: {{ $spec.livenessProbe.failureThreshold }}
          lifecycle:
            preStop:
              exec:
                command: ["sleep", {{ $spec.preStopSleep | quote }}]
          resources: {{ toJson $resources }}
          securityContext: {{ toJson $root.Values.securityContext }}
          volumeMounts:
            - name: shm
              mountPath: /dev/shm
            - name: tmp
              mountPath: /tmp
            {{- with include "swaserve.modelVolumeMounts" $root }}{{ . | nindent 12 }}{{- end }}
            {{- with include "swaserve.grpcTlsMount" $root }}{{ . | nindent 12 }}{{- end }}
            {{- if and (gt $epSize 1) $placement }}
            - name: ep-placement
              mountPath: /etc/swaserve/ep
              readOnly: true
            {{- end }}
      volumes:
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $shm }}
        - name: tmp
          emptyDir: {}
        {{- with include "swaserve.modelVolumes" $root }}{{ . | nindent 8 }}{{- end }}
        {{- with include "swaserve.grpcTlsVolume" $root }}{{ . | nindent 8 }}{{- end }}
        {{- if and (gt $epSize 1) $placement }}
        - name: ep-placement
          configMap:
            name: {{ .name }}-ep
        {{- end }}
{{- end -}}

{{/*
The autoscaler of one worker Deployment: a KEDA ScaledObject or an HPA (never both).
Args (dict): root, name (the Deployment), component, bucket, spec.
*/}}
{{- define "swaserve.workerAutoscaler" -}}
{{- $root := .root -}}
{{- $a := .spec.autoscaling -}}
{{- if $a.enabled -}}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) -}}
{{- fail (printf "%s autoscaling: minReplicas %d > maxReplicas %d" .name (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- /* KEDA's admission webhook takes names up to 54 characters */ -}}
{{- $obj := .name -}}
{{- if gt (len $obj) 54 }}{{ $obj = printf "%s-%s" (trunc 45 .name | trimSuffix "-") (sha256sum .name | trunc 8) }}{{ end -}}
{{- $sel := printf "namespace=%q,release=%q,component=%q" $root.Release.Namespace $root.Release.Name .component -}}
{{- if .bucket }}{{ $sel = printf "%s,bucket=%q" $sel .bucket }}{{ end -}}
{{- if eq $a.type "keda" -}}
{{- if not ($root.Capabilities.APIVersions.Has "keda.sh/v1alpha1/ScaledObject") -}}
{{- fail (printf "%s.autoscaling.type keda needs KEDA's CRDs (keda.sh/v1alpha1 ScaledObject) in the cluster; install KEDA, or use type hpa" .component) -}}
{{- end }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ $obj }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "swaserve.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicaCount: {{ $a.minReplicas }}
  maxReplicaCount: {{ $a.maxReplicas }}
  pollingInterval: 15
  cooldownPeriod: 300
  fallback:
    failureThreshold: 3
    replicas: {{ $a.minReplicas }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        scaleDown:
          stabilizationWindowSeconds: 300
  triggers:
    # the pods' own series (services/worker_metrics.py), selected by the PodMonitor's labels
    # waiting requests per replica (AverageValue: the sum is divided by the replica count)
    - type: prometheus
      metricType: AverageValue
      metadata:
        serverAddress: {{ $a.prometheusAddress }}
        query: sum(swaserve:worker_num_requests_waiting{ {{- $sel -}} })
        threshold: {{ $a.queueThreshold | quote }}
    # KV held by requests (prefix-cache pages are evictable: not counted) in the fuller pool,
    # averaged over the replicas
    - type: prometheus
      metricType: Value
      metadata:
        serverAddress: {{ $a.prometheusAddress }}
        query: avg(max by (pod) ((swaserve:kv_cache_used_pages{ {{- $sel -}} } - swaserve:prefix_cache_pages{ {{- $sel -}} }) / swaserve:kv_cache_total_pages{ {{- $sel -}} }))
        threshold: {{ $a.kvUsageThreshold | quote }}
{{- else }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $obj }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "swaserve.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  behavior:
    scaleDown:
      stabilizationWindowSeconds: 300
  metrics:
    # the pods' own series served by prometheus-adapter under colon-free names (docs/OPERATIONS.md)
    - type: Pods
      pods:
        metric:
          name: swaserve_worker_num_requests_waiting
        target:
          type: AverageValue
          averageValue: {{ $a.queueThreshold | quote }}
    - type: Pods
      pods:
        metric:
          name: swaserve_kv_cache_request_usage
        target:
          type: AverageValue
          averageValue: {{ $a.kvUsageThreshold | quote }}
{{- end }}
{{- end }}
{{- end -}}
